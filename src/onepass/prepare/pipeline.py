"""Prepare: conversations -> views -> scheduled trees -> rows, with honest statistics.

Why this module exists: it is the data flow of docs/design.md in one function, and
the place where nothing is lost silently. Every record that cannot be used
(bad record, template that cannot split a turn, a view over the budget) is
counted with its reason in :class:`PrepareStats`, printed, and written to
``stats.json`` next to the rows.

On disk: a HF ``datasets`` Arrow dataset with exactly the columns
``input_ids, position_ids, kv_end, targets, weights`` (one row per packed row,
or per tree when not packing; names and dtypes from
:data:`onepass.layout.tree.ROW_SCHEMA`, stored as ``ROW_DISK_DTYPES``) and
``stats.json``. ``onepass prepare`` streams (:func:`write_prepared`: rows are
written as each conversation's trees are made, stats are counters), so memory
does not grow with the data; :func:`prepare` then :func:`write_dataset` is the
same in memory, the reference it is tested against. The directory is written
under a temporary name and renamed when complete (:func:`onepass.files.atomic_dir`),
so a crash never leaves a half-written dataset behind; a marker file
(``.onepass-output``) says a later run may replace it (``onepass.files.check_output_dir``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from onepass.conversation.parse import Conversation
from onepass.prepare.config import DataConfig
from onepass.errors import DataError, DataNotFound
from onepass.files import WriteError, atomic_dir, write_failure, write_marker
from onepass.layout.flops import token_ratio
from onepass.layout.pack import best_fit_decreasing, pack_layouts
from onepass.conversation.schemas import GREETING, INLINE_KEPT
from onepass.render import Rendered, render_conversation
from onepass.render.single import SingleRendering, add_counts, single_rendering
from onepass.layout.schedule import schedule_views
from onepass.prepare.shards import RowWriter, TreeSpool
from onepass.layout.share import prefix_key, share_and_pack, share_trees
from onepass.layout.tree import COLUMNS, ROW_DISK_DTYPES, Layout, count_nodes, row_from_columns, rows_to_columns, concat
from onepass.layout.view import PROVENANCE_FLAGS, count_provenance


PrepareConfig = DataConfig
"""Prepare's settings are the data settings (:class:`onepass.prepare.config.DataConfig`), nothing more."""


INVALID = "invalid record"  # the skip reason of a record that is not a conversation


def _setting(default: Any) -> Any:
    """A field saying what the counts are of (:meth:`PrepareStats.configure`), not a count."""
    return field(default=default, metadata={"merge": "setting"})


def _whole(default: Any) -> Any:
    """A count of the whole set, known once every row is made (:func:`count_rows`): not a running total."""
    return field(default=default, metadata={"merge": "whole"})


def _skips() -> Any:
    """The skip list and counts: merged skip by skip (:meth:`PrepareStats.skip`), in order."""
    return field(default_factory=list, metadata={"merge": "skips"})


@dataclass(kw_only=True)
class PrepareStats:
    """Counts a user checks before training. Token counts are over kept views.

    Every field that is not a setting, a whole-set count or the skips is a running total, summed when
    the counts of conversations prepared apart are merged (:meth:`counts`, :meth:`add`: the forked
    workers of :mod:`onepass.prepare.parallel`): a new counter is one field, merged by itself. The
    views' :class:`~onepass.layout.view.Provenance` flags are counted in ``provenance`` and written as
    ``views_<flag>`` (:meth:`to_dict`).
    """

    schedule: str = _setting("")
    weighting: str = _setting("")
    max_tokens: int | None = _setting(None)
    packed: bool = _setting(False)
    completion_format: str | None = _setting(None)  # --completion-format: views built from it, none split by the
    # template; --reasoning: "drop" trains a turn whose reasoning the template never renders without it
    reasoning: str = _setting("keep")
    train_turns: str = _setting("all")  # --train-turns: which assistant turns get a view (all, last, weight)
    template_date: str | None = _setting(None)  # --template-date: the date a template that reads the clock rendered
    conversations: int = 0  # read and valid
    conversations_used: int = 0  # at least one view trained
    views: int = 0
    views_trained: int = 0
    views_skipped: int = 0
    provenance: dict[str, int] = field(default_factory=lambda: count_provenance(()))  # views per Provenance flag
    boundary_merge_views: int = 0  # prompt|completion tokenized apart differs from tokenized whole
    turns_not_trained: int = 0  # assistant turns the record marks not to train (OpenAI "weight": 0): context only
    turns_not_selected: int = 0  # assistant turns --train-turns (last, weight) leaves as context: no view
    tool_arguments_parsed: int = 0  # JSON-string tool-call arguments parsed for a template that needs a dict
    conversions: dict[str, int] = field(default_factory=dict)  # records read by a conversion (schemas.CONVERSIONS)
    n_pass_tokens: int = 0  # sum of view lengths
    one_pass_tokens: int = 0  # one tree per conversation
    scheduled_tokens: int = 0  # tokens of this schedule's trees
    token_ratio: float = _whole(0.0)  # n_pass_tokens / one_pass_tokens
    target_tokens: int = 0
    trees: int = _whole(0)
    rows: int = _whole(0)
    row_tokens: int = _whole(0)
    padding_tokens: int = _whole(0)  # rows * max_tokens - row_tokens when packing
    padding_fraction: float = _whole(0.0)
    skipped: list[str] = _skips()  # one line per skip: where and why
    skipped_by_reason: dict[str, int] = field(default_factory=dict, metadata={"merge": "skips"})
    shared: dict[str, Any] | None = _whole(None)  # packing with shared prefixes (onepass.layout.share): see SharedStats
    single_rendering: dict[str, int] = field(default_factory=dict)  # what one rendering of each conversation would
    # train instead of its views (onepass.render.single.SingleRendering's counts, summed)

    def skip(self, reason: str, message: str, count: int = 1) -> None:
        """Count a skip of ``count`` views (or one record) under ``reason``. Invalid records are listed
        first, in their order (a reader that reads every record before preparing reports them first), so a
        streaming run writes the same list."""
        if reason == INVALID:
            self.skipped.insert(self.skipped_by_reason.get(INVALID, 0), message)
        else:
            self.skipped.append(message)
        self.skipped_by_reason[reason] = self.skipped_by_reason.get(reason, 0) + count

    def configure(self, config: PrepareConfig) -> PrepareStats:
        """Record what the counts are of (schedule, weighting, budget, packing, the template's date, shared
        prefixes)."""
        self.schedule, self.weighting = str(config.schedule_spec), config.weighting
        self.max_tokens, self.packed = config.max_tokens, config.pack
        self.completion_format, self.reasoning = config.completion_format, config.reasoning
        self.train_turns = config.train_turns
        self.template_date = config.template_date
        if config.shares and self.shared is None:
            self.shared = asdict(SharedStats(window=config.share_window))
        return self

    def counts(self) -> dict[str, Any]:
        """The running totals (every field but the settings, whole-set counts and skips): what
        :meth:`add` merges."""
        return {f.name: copy.copy(getattr(self, f.name)) for f in fields(self) if "merge" not in f.metadata}

    def add(self, counts: dict[str, Any], skips: Iterable[tuple[str, str, int]]) -> None:
        """Merge one conversation's :meth:`counts` and skips, counted elsewhere (a worker)."""
        for k, value in counts.items():
            if isinstance(value, dict):
                for name, n in value.items():
                    getattr(self, k)[name] = getattr(self, k).get(name, 0) + n
            else:
                setattr(self, k, getattr(self, k) + value)
        for reason, message, count in skips:
            self.skip(reason, message, count)

    def to_dict(self) -> dict[str, Any]:
        """Plain values, as ``stats.json`` holds them: the provenance counts as ``views_<flag>``; ``shared``
        only when packing shared prefixes (else stats.json as before sharing existed)."""
        out: dict[str, Any] = {}
        for key, value in asdict(self).items():
            if key == "provenance":
                out.update({f"views_{flag}": value[flag] for flag in PROVENANCE_FLAGS})
            elif not (key == "shared" and value is None):
                out[key] = value
        return out

    def summary(self) -> str:
        lines = [
            f"conversations {self.conversations} (used {self.conversations_used}), views {self.views} "
            f"(trained {self.views_trained}, skipped {self.views_skipped})",
            f"tokens: N-pass {self.n_pass_tokens:,}  one-pass {self.one_pass_tokens:,}  "
            f"ratio {self.token_ratio:.2f}x  ({self.schedule}: {self.scheduled_tokens:,} in {self.trees} trees)",
            f"rows {self.rows}, row tokens {self.row_tokens:,}, padding {self.padding_tokens:,} "
            f"({self.padding_fraction:.1%}), targets {self.target_tokens:,}",
        ]
        by_template = sum(self.skipped_by_reason.get(r, 0) for r in ("template", "template error"))
        flagged = self.provenance
        if by_template or flagged["derived"]:
            how = "from the completion format" if self.completion_format else "split cleanly"
            lines.append(f"template: {self.views - by_template - flagged['derived']} of {self.views} views {how}, "
                         f"{flagged['derived']} use the generation format derived from the template, "
                         f"{by_template} skipped by the template (onepass templates check: why)")
        if flagged["reasoning_dropped"] or flagged["history_reasoning_dropped"]:
            lines.append(f"reasoning left out: {flagged['reasoning_dropped']} views by --reasoning drop, "
                         f"{flagged['history_reasoning_dropped']} views where the template drops an earlier "
                         "turn's reasoning")
        if self.conversions or self.turns_not_trained or self.turns_not_selected or self.tool_arguments_parsed:
            what = [f"{n} records {name}" for name, n in sorted(self.conversions.items())]
            what += [f"{self.turns_not_trained} assistant turns not trained (weight 0)"] * bool(self.turns_not_trained)
            what += [f"{self.turns_not_selected} assistant turns left as context (--train-turns {self.train_turns})"
                     ] * bool(self.turns_not_selected)
            what += [f"{self.tool_arguments_parsed} JSON-string tool arguments parsed (the template needs a dict)"
                     ] * bool(self.tool_arguments_parsed)
            lines.append("read: " + "; ".join(what))
        if self.boundary_merge_views:
            lines.append(f"{self.boundary_merge_views} views tokenize differently when prompt and "
                         "completion are joined (a BPE merge across the boundary); trained as at inference")
        if self.single_rendering:
            lines.append(SingleRendering(**self.single_rendering).summary())
        if self.shared is not None:
            sh = self.shared
            lines.append(f"shared prefixes: {sh['trees_shared']} of {self.trees} trees merged into {sh['groups']} "
                         f"trees across conversations, {sh['shared_prefix_tokens']:,} tokens fewer "
                         f"({sh['tokens_unshared']:,} -> {self.row_tokens:,}); N-pass / row tokens "
                         f"{sh['row_token_ratio']:.2f}x" + (f"; window {sh['window']} conversations" if sh["window"]
                                                             else ""))
        if self.skipped:
            lines.append(f"SKIPPED {self.skip_summary()}")
        return "\n".join(lines)

    def none_trained(self) -> str:
        """Why nothing is left to train, as a clause after "nothing to train: ": what was given and what
        happened to it (the counts of this record), never "no conversations" when some were read.

        >>> PrepareStats(conversations=3, turns_not_trained=5).none_trained()
        '3 conversations given, none trained: each of their 5 assistant turns is marked not to train (weight 0)'
        """
        if not self.conversations:
            return ("the data has no conversations" if not self.skipped
                    else f"no valid conversation; {self.skip_summary()}")
        given = f"{self.conversations} conversation{'s' * (self.conversations != 1)} given, none trained"
        if not self.views and self.turns_not_trained:
            return (f"{given}: each of their {self.turns_not_trained} assistant turns is marked not to train "
                    "(weight 0)")
        if not self.views:
            return f"{given}: they hold no assistant turn to train"
        what = f"{given}: every view was skipped, {self.skip_summary()}" if self.skipped else given
        return what + (f" ({self.turns_not_trained} assistant turns marked weight 0)" if self.turns_not_trained
                       else "")

    def skip_summary(self) -> str:
        """``N (reason: count, ...); first: message`` (empty when nothing was skipped)."""
        if not self.skipped:
            return ""
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped_by_reason.items()))
        return f"{sum(self.skipped_by_reason.values())} ({reasons}); first: {self.skipped[0]}"


@dataclass(kw_only=True)
class SharedStats:
    """``stats.json``'s ``shared`` section, written when packing shares prefixes (:mod:`onepass.layout.share`)."""

    window: int | None = None  # --share-window: conversations (in input order) sharing may span; None: all
    groups: int = 0  # trees made of two or more conversations' trees
    trees_shared: int = 0  # trees (of the schedule) merged with another conversation's
    tokens_unshared: int = 0  # tokens of the schedule's trees: the row tokens without sharing
    shared_prefix_tokens: int = 0  # tokens_unshared - row tokens: each computed once per row instead
    row_token_ratio: float = 0.0  # N-pass tokens / row tokens


def prepare(conversations: Iterable[Conversation], tokenizer: Any, config: PrepareConfig | None = None,
            *, stats: PrepareStats | None = None, progress: bool = False,
            total: int | None = None, strict: bool = False) -> tuple[list[Layout], PrepareStats]:
    """Rows (packed or one per tree) for ``conversations`` and their statistics.

    A turn the template cannot split (or raises for) is counted and skipped on its own, the
    conversation's other views kept; with ``strict`` its :class:`~onepass.render.RenderError` is raised.
    ``config`` None: the default settings (the template's date is today's, resolved here).
    """
    config = config if config is not None else PrepareConfig()
    stats = (stats or PrepareStats()).configure(config)
    units: list[list[Layout]] = []
    items: Iterable[Conversation] = conversations
    if progress:
        from tqdm.auto import tqdm

        items = tqdm(conversations, total=total, desc="prepare", unit="conv")
    for conv in items:
        units.append(prepare_conversation(conv, tokenizer, config, stats, strict=strict))
    return finalize(units, stats, config)


def prepare_conversation(conv: Conversation, tokenizer: Any, config: PrepareConfig, stats: PrepareStats, *,
                         strict: bool = False, on_rendered: Callable[[Rendered], None] | None = None) -> list[Layout]:
    """The trees (unpacked) of one conversation; its counts and skips go into ``stats``. ``on_rendered``
    sees its rendering (the exactness guard's sample: :class:`onepass.prepare.guard_sample.ViewSample`), so a run
    renders each conversation once."""
    stats.conversations += 1
    rendered = render_conversation(conv, tokenizer, config.render, max_tokens=config.max_tokens, keep_texts=True)
    stats.single_rendering = add_counts(stats.single_rendering, single_rendering(conv, tokenizer, config.render,
                                                                                 rendered, max_tokens=config.max_tokens))
    if on_rendered is not None:
        on_rendered(rendered)
    if strict and rendered.skipped:
        raise rendered.skipped[0]
    for name in conv.conversions + (INLINE_KEPT,) * bool(rendered.inline_reasoning) + (
            GREETING,) * bool(rendered.greeting_not_trained):
        stats.conversions[name] = stats.conversions.get(name, 0) + 1
    stats.turns_not_trained += rendered.not_trained
    stats.turns_not_selected += rendered.not_selected
    stats.tool_arguments_parsed += rendered.arguments_parsed
    for error in rendered.skipped:
        stats.skip(error.reason, str(error))
    stats.views += len(rendered.views) + len(rendered.skipped)
    stats.views_skipped += len(rendered.skipped)
    count_provenance(rendered.views, stats.provenance)
    views = list(rendered.views)
    if not views:
        return []
    scheduled = schedule_views(views, config.schedule_spec, weighting=config.weighting, max_tokens=config.max_tokens)
    for message, count in zip(scheduled.skipped, scheduled.skipped_views, strict=True):
        stats.skip("over max_tokens", message, count)  # a tree over the budget: every view in it counts
    stats.views_skipped += scheduled.num_views_skipped
    trained = sorted(i for g in scheduled.groups for i in g)
    if not trained:
        return []
    stats.conversations_used += 1
    stats.views_trained += len(trained)
    stats.boundary_merge_views += sum(views[i].boundary_merge for i in trained)
    stats.n_pass_tokens += sum(len(views[i]) for i in trained)
    if len(scheduled.layouts) == 1:  # its one tree holds every trained view: the one-pass tree
        stats.one_pass_tokens += len(scheduled.layouts[0])
    else:
        stats.one_pass_tokens += count_nodes([views[i] for i in trained])
    for layout in scheduled.layouts:
        stats.scheduled_tokens += len(layout)
        stats.target_tokens += layout.num_targets
    return scheduled.layouts


def units_of(items: Iterable[Layout | Sequence[Layout]]) -> Iterator[tuple[int, Layout]]:
    """``(conversation, tree)`` of each tree: ``items`` are each conversation's trees (a list), or trees
    (each then its own conversation, as :func:`onepass.prepare.parallel.iter_prepared` yields them by default)."""
    unit = 0
    for item in items:
        trees = [item] if isinstance(item, Layout) else item
        for tree in trees:
            yield unit, tree
        unit += bool(trees)  # conversations numbered among those with trees, however they come


def finalize(units: Sequence[Layout | Sequence[Layout]], stats: PrepareStats, config: PrepareConfig
             ) -> tuple[list[Layout], PrepareStats]:
    """After the per-conversation loop over ``units`` (each conversation's trees; a bare tree is its own):
    pack (sharing prefixes across conversations when ``config.shares``), count rows and padding, the
    token ratio."""
    pairs = list(units_of(units))
    layouts = [tree for _, tree in pairs]
    if config.shares:
        assert config.max_tokens is not None
        shared = share_and_pack(layouts, [u for u, _ in pairs], config.max_tokens, window=config.share_window)
        rows = shared.rows
        count_shared(stats, config, layouts, [m for m in shared.groups if len(m) > 1])
    else:
        rows = pack_layouts(layouts, config.max_tokens) if config.pack else layouts
    count_rows(stats, config, num_trees=len(layouts), num_rows=len(rows), row_tokens=sum(len(r) for r in rows))
    return rows, stats


def count_shared(stats: PrepareStats, config: PrepareConfig, trees: Sequence[Layout] | Sequence[int],
                 groups: Sequence[Sequence[int]]) -> None:
    """The ``shared`` counts of trees merged into ``groups`` (each two or more tree indices); ``trees``:
    the trees or their lengths. The token counts are completed by :func:`count_rows`."""
    if stats.shared is None:
        stats.shared = asdict(SharedStats(window=config.share_window))
    stats.shared["groups"] = len(groups)
    stats.shared["trees_shared"] = sum(len(g) for g in groups)
    stats.shared["tokens_unshared"] = sum(x if isinstance(x, int) else len(x) for x in trees)


def count_rows(stats: PrepareStats, config: PrepareConfig, *, num_trees: int, num_rows: int,
               row_tokens: int) -> PrepareStats:
    """The counts known once every row is made: trees, rows, padding, the token ratio, tokens shared."""
    stats.trees, stats.rows, stats.row_tokens = num_trees, num_rows, row_tokens
    if config.pack and config.max_tokens:
        stats.padding_tokens = stats.rows * config.max_tokens - stats.row_tokens
        stats.padding_fraction = stats.padding_tokens / max(1, stats.rows * config.max_tokens)
    stats.token_ratio = token_ratio(stats.n_pass_tokens, stats.one_pass_tokens)
    if stats.shared is not None and not stats.shared["groups"]:
        stats.shared = None  # nothing was shared: no section (stats.json as without sharing, docs/cli.md)
    if stats.shared is not None:
        stats.shared["shared_prefix_tokens"] = stats.shared["tokens_unshared"] - row_tokens
        stats.shared["row_token_ratio"] = token_ratio(stats.n_pass_tokens, row_tokens)
    return stats


def write_dataset(rows: list[Layout], stats: PrepareStats, out_dir: str | Path) -> Path:
    """Write the Arrow dataset and ``stats.json`` atomically (temp dir, then rename), from rows in
    memory: the slow reference of :func:`write_prepared` (``tests/prepare/test_prepare_stream.py``)."""
    import datasets

    out = Path(out_dir)
    features = datasets.Features({c: datasets.Sequence(datasets.Value(t)) for c, t in ROW_DISK_DTYPES.items()})
    ds = datasets.Dataset.from_dict(rows_to_columns(rows), features=features)
    bars_were_on = datasets.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # prepare has its own progress bar
    with atomic_dir(out, replace=True) as tmp:
        try:
            ds.save_to_disk(str(tmp))
        finally:
            if bars_were_on:
                datasets.enable_progress_bars()
        (tmp / "stats.json").write_text(json.dumps(stats.to_dict(), indent=2) + "\n", encoding="utf-8")
        write_marker(tmp, "prepared")
    return out


class _NothingToWrite(Exception):
    pass


def write_prepared(trees: Iterable[Layout | Sequence[Layout]], stats: PrepareStats, config: PrepareConfig,
                   out_dir: str | Path) -> Path | None:
    """Stream ``trees`` (unpacked, in order: trees, or each conversation's list of trees, see
    :func:`units_of`) into the prepared dataset ``out_dir``; what ``prepare`` then ``write_dataset``
    write, in memory that does not grow with the data (:mod:`onepass.prepare.shards`).

    Rows are written as trees arrive; with packing the trees wait in a spool file and only their
    lengths (and, sharing prefixes, a key of 11 integers: :func:`onepass.layout.share.prefix_key`) in memory,
    then are merged and packed exactly as :func:`finalize` does (:func:`onepass.layout.share.share_and_pack`,
    :func:`onepass.layout.pack.pack_layouts`). ``stats`` is completed (:func:`count_rows`) and written beside
    the rows. Published atomically when complete (:func:`onepass.files.atomic_dir`); when there is no
    row nothing is published (an earlier output stays) and None is returned.
    """
    out = Path(out_dir)
    trees = _marked_as_data(trees)
    try:
        with atomic_dir(out, replace=True) as tmp:
            with RowWriter(tmp) as rows:
                num_trees = 0
                if config.pack:
                    assert config.max_tokens is not None
                    with TreeSpool(tmp / ".trees.spool") as spool:
                        keys, units = [], []
                        for unit, tree in units_of(trees):
                            spool.append(tree)
                            if config.shares:
                                keys.append(prefix_key(tree))
                                units.append(unit)
                        num_trees = len(spool.lengths)
                        if config.shares:
                            with TreeSpool(tmp / ".shared.spool") as merged:
                                groups = []
                                for m in share_trees(keys, units, spool.read, config.max_tokens,
                                                     window=config.share_window):
                                    merged.append(m.layout)
                                    if len(m.members) > 1:
                                        groups.append(m.members)
                                count_shared(stats, config, spool.lengths, groups)
                                for b in best_fit_decreasing(merged.lengths, config.max_tokens):
                                    rows.write(concat([merged.read(i) for i in b]))
                        else:
                            for b in best_fit_decreasing(spool.lengths, config.max_tokens):
                                rows.write(concat([spool.read(i) for i in b]))
                else:
                    for _, tree in units_of(trees):
                        rows.write(tree)
                        num_trees += 1
                if not rows.num_rows:
                    raise _NothingToWrite
            count_rows(stats, config, num_trees=num_trees, num_rows=rows.num_rows, row_tokens=rows.num_tokens)
            (tmp / "stats.json").write_text(json.dumps(stats.to_dict(), indent=2) + "\n", encoding="utf-8")
            write_marker(tmp, "prepared")
    except _NothingToWrite:
        count_rows(stats, config, num_trees=0, num_rows=0, row_tokens=0)
        return None
    except Exception as e:  # a full disk, a file-size limit, a quota: one line, the temporary gone, the old output kept
        reason = None if getattr(e, "onepass_from_data", False) else write_failure(e)
        if reason is None:
            raise
        kept = "the earlier output there is kept" if out.exists() else "nothing was written there"
        raise WriteError(f"cannot write the prepared rows to {out} ({reason}); {kept}: free space (or raise the "
                         "file-size limit) and prepare again") from None
    return out


def _marked_as_data(items: Iterable[Any]) -> Iterator[Any]:
    """``items``, with an error raised while making them (reading and rendering the data) marked as not a
    failed write: an ``OSError`` of the data (a file that cannot be read) is not a full disk."""
    it = iter(items)
    while True:
        try:
            item = next(it)
        except StopIteration:
            return
        except Exception as e:
            e.onepass_from_data = True  # type: ignore[attr-defined]
            raise
        yield item


def load_rows(path: str | Path) -> list[Layout]:
    """Rows of a prepared dataset directory, as :class:`Layout` records."""
    import datasets

    if not Path(path).is_dir():
        raise DataNotFound(f"prepared dataset not found: {path}")
    # Arrow, not the "numpy" format: that one casts every float column to float32 (1/n weights would drift).
    try:
        ds = datasets.load_from_disk(str(path)).with_format("arrow")
        rows = []
        for batch in ds.iter(batch_size=256):
            columns = {c: batch.column(c) for c in COLUMNS}
            for i in range(batch.num_rows):
                rows.append(row_from_columns({c: a[i].values.to_numpy(zero_copy_only=False)
                                              for c, a in columns.items()}))
    except (OSError, ValueError, KeyError) as e:  # a cut or foreign shard (pyarrow's errors are ValueError/OSError)
        raise DataError(f"prepared dataset {path} cannot be read ({(str(e).splitlines() or [type(e).__name__])[0]}); "
                        "it is damaged or incomplete: prepare it again") from None
    return rows
