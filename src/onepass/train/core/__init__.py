"""What ``onepass train`` (:mod:`onepass.train.run`) and ``OnePassTrainer`` (:mod:`onepass.train.trainer`)
share: written once, called by both front ends.

    normalise.py    the step's loss normaliser and the held-out weighted mean (one quotient)
    guard.py        the exactness guard's call: the views, the tiny twin's verdict, the one log line
    load.py         the one loader of the model to train and of its tokenizer
    units.py        a unit: the trees of one conversation, prepared one at a time
    sft_rows.py     TRL's dataset types (text, prompt-completion, tokenized) as TRL's rows
    report.py       metrics.json + metrics.jsonl, trackers, the loss plot
"""
