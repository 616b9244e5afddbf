"""Conversations in: record files read, public schemas mapped, ``--data`` resolved, each record validated.

The first stage of the pipeline (no torch):

``records``   record files: ``.jsonl`` line by line, ``.json``, ``.parquet``
``schemas``   the schemas public datasets use (ShareGPT, OpenAI weight, Hermes, content parts...) read into
              our messages, counted, or refused in one line naming the nearest
``sources``   a ``--data`` spec resolved once to a :class:`~onepass.data.sources.DataSource`
              (file, folder, saved dataset, ``builtin:``, ``synthetic:``, hub id); records streamed, skips reported
``parse``     a record -> :class:`~onepass.conversation.parse.Conversation`: every shape, validated
``turns``     which assistant turns are trained (``--train-turns``: all, last, or those a record marks)

Next stage: :mod:`onepass.render` (a conversation's views by its chat template).
"""
