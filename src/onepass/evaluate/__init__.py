"""``onepass eval``: multi-turn accuracy of a model, generated turn by turn as at inference.

Why this package exists: training loss says nothing about whether a
fine-tuned reasoning model answers turn 3 better. This package generates each
assistant turn in the context the model really gets (its own chat template,
earlier reasoning dropped), extracts final answers and reports accuracy per
turn and per conversation depth. (Named ``evaluate``: a module named ``eval``
would shadow the builtin.)

    answers.py   final-answer extraction ("The answer is X", \\boxed{}, a regex) and comparison
    generate.py  engines: transformers generate, vLLM, OpenAI-compatible servers
    run.py       the turn-by-turn loop, reference or model history
    report.py    per-turn / per-depth accuracy: JSON, Markdown, PNG
    cli.py       the command
"""
