"""Conversations in: record files read, public schemas mapped, each record validated.

The first stage of the pipeline (no torch):

``records``   record files: ``.jsonl`` line by line, ``.json``, ``.parquet``
``schemas``   the schemas public datasets use (ShareGPT, OpenAI weight, Hermes, content parts...) read into
              our messages, counted, or refused in one line naming the nearest
``parse``     a record -> :class:`~onepass.conversation.parse.Conversation`: every shape, validated
``turns``     which assistant turns are trained (``--train-turns``: all, last, or those a record marks)

A ``--data`` spec (a file, a folder, a saved dataset, the bundled and synthetic data, a hub id) is resolved
one layer up, beside the datasets it names: :mod:`onepass.data.sources`. Next stage: :mod:`onepass.render`
(a conversation's views by its chat template).
"""
