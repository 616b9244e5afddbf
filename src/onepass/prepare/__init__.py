"""``onepass prepare``: conversations -> one-pass rows on disk, streamed (no torch).

``config``    :class:`~onepass.prepare.config.DataConfig`: the data settings of every entry point, parsed
              once; their flags
``pipeline``  a conversation's trees and :class:`~onepass.prepare.pipeline.PrepareStats`; rows written to
              Arrow as they are made; prepared rows read back
``parallel``  the pipeline as a stream, on one process or forked workers, equal to the serial one
``shards``    rows to Arrow shards as they are made (``save_to_disk`` layout); a tree spool for packing
``cli``       ``onepass prepare``: its parser and run
``guard_sample``  the exactness guard's conversations, taken as the run prepares them
``show``      ``onepass show``: one conversation's mask as a PNG (a command above what it calls)
``template_report``  ``onepass templates check``: which views split, which are skipped and why
``data_cli``  ``onepass data ...``: the dataset commands (``data stats`` reads prepare's render flags)
"""
