"""Training the small learned parts: the model's own answers as data (`self_distill.py`) and APAR's
fine-tuning data and loss (`apar_finetune.py`). The program that runs them is train_prompt.py; the
losses of Medusa's heads and PPD's soft tokens sit beside their methods (methods/medusa.py, methods/ppd.py).
"""
