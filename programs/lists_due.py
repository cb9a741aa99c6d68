"""Which held-out list-style prompts a list is due on, labelled by hand: the measure behind `bench.py
apar`'s "forked where a list is due". APAR (Liu et al. 2024) forks where an answer has listed
structure (section 2.1: "most listed structures are naturally suitable for paralleled generation");
the rest it learns to write in one thread (section 3.1's unstructured data).

apar_finetune.looks_list_style picks ShareGPT prompts by their words (list, tips, steps, examples, ...),
which also picks requests whose answer is not a list: an Android activity's code "with a list of
items", a 1000-word essay that "should outline" a concept. Each of the 90 list-style prompts held out
of the shipped adapter's 3000 (both halves of `bench.py apar --held-out-lists`) is labelled here from
its wording alone, not from any answer to it:

- "due": it asks for several items: a list, N things, ideas, tips, steps, features, examples, an
  outline, or an answer in named sections;
- "not due": it asks for code, a formula, one name, a rewrite, an essay, a story, an explanation of
  one thing, or only to wait for what the user will say next;
- "either": a table, one thing that might come as steps, or a follow-up whose context is missing.

A prompt is found by the first 10 hex digits of its SHA-1; the comment after each is its first words.
"""

import hashlib

LABELS = {  # SHA-1 prefix: (label, what the prompt asks for)
    "b1cf16e1df": ("due", "a trip plan, Thursday to Sunday"),  # I want to do a road trip from Pune to Gujarat. M
    "bb858b36ce": ("due", "candidate questions to choose from"),  # help me to choose a scientific question The chos
    "e57e93458e": ("due", "a UX flow over the listed features"),  # You're an AI product manager and UX researcher.
    "0c14314463": ("due", "a list of homework questions"),  # Give me a list of typical homework questions rel
    "358b4a352d": ("due", "5 titles"),  # Suggest 5 titles for an academic paper. Here's t
    "880232068a": ("due", "ten name ideas"),  # I am interested in starting a business that opti
    "effb0bd2ea": ("due", "ideas to solve an error"),  # I tried typing vcgencmd measure\_temp on a raspb
    "e756d90132": ("due", "a shorter list (its context missing)"),  # please continue and make the list shorter
    "f1034829b7": ("due", "an outline with multiple steps"),  # Write an outline of a programming challenge for
    "eb0990ea83": ("due", "a bulleted pros and cons list"),  # I need a bulleted pros & con list between the to
    "4491854956": ("not due", "a spreadsheet formula"),  # In Google Sheets in Column A I have a list of re
    "57684dfd98": ("not due", "a 1000-word essay"),  # Write an essay on the topic 'Create the law for
    "19c98af7c6": ("not due", "an Android activity's code"),  # Android Java - Shop Activity (list of shopping e
    "6d039ab4d3": ("due", "a book's outline"),  # Provide an outline of this book that I want to w
    "1d3ed551ad": ("not due", "a rewritten paragraph"),  # Rewrite the given introductory paragraph so that
    "59098909a1": ("due", "ideas for summer work"),  # I’m a recent grad with a BS in geophysics and we
    "a50d9bd432": ("due", "top 20 colleges"),  # Top 20 US colleges that have a high representati
    "03ff289de4": ("not due", "a CUDA program"),  # Create a CUDA program that uses multithreading t
    "dbacfb8b64": ("due", "a marketing plan of online and offline strategies"),  # Rochdale AFC is a soccer club in th
    "c3ad25feb1": ("due", "examples of plants"),  # examples of plaants that do not undergo photosyn
    "0f4d07bfd2": ("either", "one mechanism, perhaps as steps"),  # Can you suggest a daily easy and simple mechanis
    "f92e4b68aa": ("due", "strategists to study"),  # I work in marketing as the head of a communicati
    "fbb0855d0e": ("due", "a grocery list"),  # build a costco grocery list to feed 2 people for
    "b2eb6bf913": ("due", "a book's outline"),  # Write an outline for a book on the four elements
    "dc12325a52": ("due", "a bullet list of sales copy"),  # Write a bullet list of benefit-oriented, excitin
    "78103c0eb3": ("due", "each point of a given outline elaborated"),  # elaborate on this Part 1: Introduction to Li
    "8b902ad494": ("due", "a 10-hour course's content by subject"),  # I want you to act as an educational content cre
    "a73aaadfe1": ("due", "a list of house numbers and their meanings"),  # continue writing the list: Create a list o
    "9381242725": ("due", "paragraphs, then lists of skills and tools"),  # create a job description for a growth hack
    "97f7bb86f7": ("either", "projects in a Markdown table"),  # I want you to act as an online course instructor
    "892ee9dc20": ("due", "50+ AI tools"),  # 50+ ai tools list
    "0a7b0ad382": ("due", "an article in named sections with a bullet list"),  # write a markdown blog article about S
    "8b17dec159": ("either", "prices of a list it was not given"),  # can you give me the prices of this list based on
    "f7556660f2": ("due", "landing-page sections: benefits, how it works, FAQ"),  # Give me landing page copies and de
    "a6fd148249": ("not due", "Python code"),  # can you write a python code to do all above step
    "e162f96ebc": ("due", "a rating per city"),  # I am writing a list of cities in the world and I
    "198f52a739": ("due", "20 topics"),  # can you create a list of 20 topics on Modular Sc
    "d2d2f90e3a": ("due", "game ideas"),  # Propose game ideas around the theme of 'friendly
    "f0d92e4a41": ("due", "top 10 analogies"),  # Top 10 analogies in different fields for example
    "2bd08bdda5": ("not due", "an Odoo module"),  # Can you create one Odoo Voice module for connect
    "8317d1d25c": ("due", "useful expressions"),  # can you list useful expressions to describe the
    "961e64fc79": ("not due", "it asks to hear the research idea first"),  # I am in the process of preparing a grant
    "48186b65cc": ("due", "bullet points of a profile's contents"),  # So we are creating deepened developer profiles
    "699da28e01": ("due", "a complete-sentence outline"),  # This is my position: Feral pigs have become a ma
    "66267b8df9": ("due", "top 10 questions"),  # Please ignore all previous instructions. I want
    "87bf591755": ("due", "5 chord progressions"),  # Give me 5 examples (including writing the notes
    "5fd1527d4c": ("due", "an app's functionalities"),  # list down the high level functionalities of an a
    "6dfae377b6": ("due", "business ideas"),  # business ideas for a business incubator with 3d
    "1d226c6978": ("either", "one combined design (its context missing)"),  # could combine the best of the three abov
    "16ce941be6": ("due", "birthday ideas"),  # Got any creative ideas for a 10 year old’s birth
    "3b018a981a": ("due", "titles of films and books"),  # list all the titles in your dataset relating to
    "d5c5ecc9ab": ("due", "10 things"),  # Generate a list of 10 things overlooked by human
    "372c2cf2ec": ("not due", "one name"),  # create a name for a dating app that uses a LLMs
    "5d0b5331dc": ("either", "follow-up questions"),  # I want you to act as a prompt generator. Your go
    "c13696488d": ("due", "key features"),  # what are key features of profit sharing software
    "68f96cb1da": ("due", "gift ideas"),  # recommend some gift ideas I can give to coworker
    "d02cbffdb7": ("not due", "a function's code"),  # Can we write a function to get all prime numbers
    "7b5d0e1c80": ("due", "advantages"),  # what are the advantages of python running bash v
    "879b357f2d": ("due", "top 20 colleges"),  # Top 20 colleges produced successful founders and
    "af84b5a89d": ("not due", "an explanation with JavaScript code"),  # tell me everything with javascript code examp
    "6ef1490d55": ("not due", "HTML, CSS and JavaScript files"),  # Assume a linux server running php apache on a la
    "d680226d56": ("due", "benefits"),  # What are the benefits of using SonarQube over so
    "c185d48ced": ("due", "steps"),  # what are the steps to create gpt myself
    "915dfb30fb": ("not due", "an explanation with Python code"),  # explain quantitative statistical analysis with e
    "fe5cfb5e4b": ("due", "the forms of entropy"),  # How many forms of entropy are there ? Can you li
    "2009ff6301": ("not due", "an explanation of one passage"),  # explain the sentence: Counterintuitive facts abo
    "f9e7724aa4": ("either", "one font, and instructions"),  # Suggest a font availiable on google fonts to add
    "6e88c46b72": ("due", "a filmography"),  # please list the filmography of the director Davi
    "3f8f941ffd": ("due", "a synopsis, then a list of characters"),  # write a plot synopsis for edgar allen poe's the
    "2d5e34bad6": ("due", "tips"),  # Act as a writing coach and provide tips for buil
    "68f2c7c7a9": ("not due", "the meaning of one phrase"),  # I'm filling out a grant application for a non-pr
    "6ed89d1d10": ("either", "an explanation of one technique"),  # Svm for exoplanet detection, and how it helps an
    "9203a63eae": ("due", "ways to improve a page"),  # Suggest some ways to improve this page: https://
    "f2bbe7c670": ("due", "a list of studies (its context missing)"),  # Can you list the most significant studies on
    "11b0f60c89": ("due", "a list of battles"),  # Can you make a list of the WWII battles with the
    "9c2909822d": ("either", "10 systems, in a table"),  # can you give me a list of 10 goal management sys
    "549b014787": ("due", "5 projects in point form"),  # List 5 sample university project that can be don
    "3696d4b294": ("not due", "an explanation of one device"),  # Explain with diagram the display processor for a
    "5bf41afbff": ("due", "meal options"),  # Your persona: You are a nutrition expert that he
    "cd622e692b": ("either", "three books' contents, not asked for in a form"),  # I want to write a three-volume seri
    "6068fd7695": ("not due", "an interview script"),  # I have been invited to interview with the Royal
    "dddeffc937": ("due", "examples"),  # Can you provide some examples on how did people
    "9c2764995c": ("due", "route suggestions"),  # I'm going on a road trip with my daughter on 3rd
    "c17aaa992a": ("due", "marketing strategies"),  # Gary Vaynerchuk's marketing strategies
    "00058636db": ("due", "a lesson plan and class activities"),  # Create a 1h40 minute lesson plan on the topic of
    "2d15e7fc6a": ("due", "a content brief: keywords, an outline, titles"),  # Create a detailed content brief for The
    "2d20fc2403": ("not due", "a short story"),  # Show me a short story descring Jack and keam fig
    "de50a8e74c": ("due", "features of UNIX"),  # . Discuss different features of UNIX Operating S
    "4ff9d6ea3a": ("due", "a solution design's components"),  # I want you to act as a solution Architect. I wil
    "073e6a331d": ("not due", "an academic analysis in prose"),  # [Writing style guideline: Use a formal and acade
}


def list_due(prompt: str) -> str | None:
    """"due", "not due" or "either" (see above), or None for a prompt not labelled here."""
    label = LABELS.get(hashlib.sha1(prompt.encode()).hexdigest()[:10])
    return label[0] if label else None
