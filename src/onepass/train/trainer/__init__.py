"""``OnePassTrainer``: a drop-in for TRL's ``SFTTrainer``, the other front end over :mod:`onepass.train.core`.

    trainer.py      OnePassTrainer: takes what SFTTrainer takes (HF Trainer, DeepSpeed, FSDP)
    model.py        model, tokenizer and special tokens loaded as TRL does (through the core's loader)
    data.py         datasets of conversations -> datasets of rows, the collator, the guard's inputs
    records.py      a trainer's records, any of TRL's dataset types mixed -> rows
    stream.py       streams read as they come, every given row checked
    sft_checks.py   SFTTrainer.__init__'s argument checks
"""
