"""What ``onepass train`` and ``OnePassTrainer`` share: written once, called by both front ends.

    normalise.py    the step's loss normaliser and the held-out weighted mean (one quotient)
    guard.py        the exactness guard's call: the views, the tiny twin's verdict, the one log line
    load.py         the one loader of the model to train and of its tokenizer
"""
