"""Training data: units, the order of optimizer steps, micro-batches and their rows.

Why this module exists: one-pass and N-pass take the *same* optimizer steps
only if each step covers the same conversations and is normalised by the
same number (the sum of target weights, which for token weighting is the
N-pass count of trained tokens). So the order is defined over *units*, not
rows: a unit is one conversation (raw data: all the trees its schedule made)
or one prepared row (a folder written by ``onepass prepare``, where
conversations are no longer known); which one a ``--data`` spec is, is decided
by :func:`onepass.data.sources.resolve_data`, as for every other command. An
epoch is a seeded shuffle of the units; a step takes the next
``batch_size * grad_accum * world`` of them; slot ``s = micro * world + rank``
takes ``batch_size`` units; the rows of a slot are its units' trees, packed
into rows of ``max_tokens`` when asked, then grouped into forward passes of
at most ``max_batch_tokens`` padded tokens (:func:`step_passes`; for held-out
data :func:`eval_passes`). Every unit lands on exactly one rank, and the
order depends only on (seed, epoch), so a resumed run recomputes it.

Example: 5 conversations, batch_size 1, grad_accum 2, 1 process, shuffle
[3 0 4 1 2] -> steps [[3 0] [4 1] [2]]; step 0 = micro-batch 0 holds
conversation 3 (one tree under one-pass, one tree per turn under n-pass),
micro-batch 1 holds conversation 0. With 2 processes and grad_accum 1, step
0 is the same two conversations, one per rank.

No torch here: the rows go to the device as :func:`onepass.loss.layouts_to_batch` tensors.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onepass.conversation.parse import Conversation
from onepass.data.sources import ROWS, DataSource, RawRecord, iter_conversation_records
from onepass.errors import ConversationError, DataError
from onepass.layout.flops import token_ratio
from onepass.prepare.guard_sample import ViewSample
from onepass.layout.pack import pack_layouts
from onepass.prepare.config import DataConfig
from onepass.prepare.pipeline import INVALID, PrepareStats, load_rows
from onepass.render.tokenizer import vocab_size
from onepass.layout.row_check import check_rows
from onepass.layout.share import Key, prefix_key, share_rows
from onepass.train.core import sft_rows
from onepass.train.config import TrainConfig, TrainConfigError
from onepass.train.core.sft_rows import SftSettings
from onepass.train.core.units import Unit, conversation_units
from onepass.layout.tree import COLUMNS as ROW_COLUMNS
from onepass.layout.tree import IGNORE, Layout, row_from_columns
from onepass.layout.view import View
from onepass.layout.vocab import layout_ids, remap_layout, used_ids

_LOG = logging.getLogger("onepass")


@dataclass(frozen=True, kw_only=True)
class TrainData:
    units: list[Unit]
    kind: str  # "conversation" | "row"
    source: str
    stats: dict[str, Any]
    guard_views: list[list[View]] = field(default_factory=list)  # conversations: the exactness guard's sample
    # sharing prefixes (onepass.layout.share; conversations, packed): each unit's prefix key, for the order of a step
    keys: list[Key | None] | None = None

    @property
    def num_units(self) -> int:
        return len(self.units)

    def weight_sum(self, indices: Sequence[int]) -> float:
        return float(sum(float(x.weights.sum()) for i in indices for x in self.units[i]))


# ---------------------------------------------------------------------------------------------
# loading


def prepare_config(config: TrainConfig) -> DataConfig:
    """How raw conversations become trees: the run's data settings, unpacked (packing happens per
    micro-batch, see the module docstring); the schedule is not parsed again."""
    return config.data_config.replace(pack=False)


def load_train_data(source: DataSource, config: TrainConfig, tokenizer: Any | None, *, progress: bool = False,
                    log: Any = _LOG.info) -> TrainData:
    """Units of ``source`` (a ``--data`` spec resolved once, by the run:
    :func:`onepass.data.sources.resolve_data`): prepared rows (one unit per row) or conversations
    (one unit per conversation, each read and rendered once; the exactness guard's views are taken from
    them, :attr:`TrainData.guard_views`)."""
    spec = source.spec
    if source.kind == ROWS:
        assert source.path is not None
        rows = load_rows(source.path)
        if config.limit is not None:
            rows = rows[:config.limit]
        stats_path = source.path / "stats.json"
        try:
            stats = json.loads(stats_path.read_text(encoding="utf-8")) if stats_path.is_file() else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{stats_path} is not JSON ({e}); prepare the data again") from None
        if not isinstance(stats, dict):
            raise DataError(f"{stats_path} holds a JSON {type(stats).__name__}, not an object; prepare the data again")
        if not rows:
            raise DataError(f"prepared dataset {spec} has no rows")
        check_rows(rows, source=f"prepared dataset {spec}")  # before any step: never train on broken rows
        budget = config.data_config.max_tokens
        if config.data_config.pack:
            too_long = max(len(r) for r in rows)
            if budget is not None and too_long > budget:
                raise TrainConfigError(f"prepared dataset {spec} has a row of {too_long} tokens, more than "
                                       f"max_tokens={budget}; raise max_tokens or prepare again")
        return TrainData(units=[[r] for r in rows], kind="row", source=spec, stats=stats)

    conversations, trl_records, skipped = read_records(source, limit=config.limit)
    stats = PrepareStats()
    for line in skipped:
        stats.skip(INVALID, line)
    if tokenizer is None:
        raise TrainConfigError("raw conversations need a tokenizer: set tokenizer")
    sample = ViewSample()
    units, stats = conversation_units(conversations, tokenizer, prepare_config(config), stats=stats,
                                      progress=progress, sample=sample)
    trl_rows = trl_units(trl_records, tokenizer, config.data_config, stats)
    if trl_rows:
        log(f"{len(trl_rows)} records of TRL's dataset types (text, prompt-completion, tokenized) train as TRL's "
            "rows: one causal sequence each, its completion (or every token) trained, as SFTTrainer trains it")
    units += trl_rows
    if stats.skipped:
        log(f"skipped {stats.skip_summary()}")
    if not units:
        raise DataError(f"nothing to train in {spec}: {stats.none_trained()}")
    keys = unit_keys(units) if config.data_config.shares else None
    return TrainData(units=units, kind="conversation", source=spec,
                     stats={**stats.to_dict(), **({"trl_rows": len(trl_rows)} if trl_rows else {})},
                     guard_views=sample.views(), keys=keys)


TEXT_FIELD = "text"
"""The column a TRL language-modeling record holds its text in (TRL's ``dataset_text_field`` default)."""


def read_records(source: DataSource, *, limit: int | None = None
                 ) -> tuple[list[Conversation], list[RawRecord], list[str]]:
    """The records of a source of conversations: the conversations, the records of TRL's other dataset types
    (text, prompt-completion, tokenized: :func:`onepass.train.core.sft_rows.record_kind`), and why each other record
    was skipped, in order; ``limit``: the first that many of the first two.

    A record that parses as a conversation is one, whatever else it holds; a record that does not, and is of
    one of TRL's other types, is kept for :func:`trl_units` (``OnePassTrainer`` takes the same types).
    """
    conversations: list[Conversation] = []
    trl: list[RawRecord] = []
    skipped: list[str] = []
    for raw in iter_conversation_records(source):
        if limit is not None and len(conversations) + len(trl) >= limit:
            break
        try:
            conversations.append(raw.parse())
        except ConversationError as e:
            if isinstance(raw.record, Mapping) and sft_rows.record_kind(raw.record, TEXT_FIELD) != sft_rows.MESSAGES:
                trl.append(raw)
            else:
                skipped.append(str(e))
    return conversations, trl, skipped


def trl_units(records: Sequence[RawRecord], tokenizer: Any, config: DataConfig, stats: PrepareStats) -> list[Unit]:
    """One unit per record of TRL's types: TRL's row of it (:func:`onepass.train.core.sft_rows.record_row`, the
    completion alone trained for prompt-completion, every token for text, the labels given for tokenized
    records), rendered with the run's ``template_kwargs`` and ``template_date``. Not truncated (as a
    conversation's tree is not): a row over ``max_tokens``, one training no token, a record of a shape TRL
    refuses, or a tokenized record holding an id the tokenizer does not have, is a counted skip in ``stats``
    naming its file and line."""
    settings = SftSettings(text_field=TEXT_FIELD, template_kwargs=dict(config.template_kwargs),
                           template_date=config.template_date, max_length=None, truncate=False)
    units: list[Unit] = []
    size = vocab_size(tokenizer) if records else 0  # the ids a tokenized record may hold: below it
    for raw in records:
        where = f"{raw.source} {raw.unit} {raw.index}"
        try:
            row = sft_rows.causal_layout(sft_rows.record_row(raw.record, tokenizer, settings, where=where))
        except DataError as e:
            stats.skip(INVALID, str(e))
            continue
        except (TypeError, ValueError) as e:  # e.g. a prompt and a completion both null
            stats.skip(INVALID, f"{where}: not a record of TRL's dataset types ({e})")
            continue
        outside = _outside_vocab(row, size) if "input_ids" in raw.record else None
        if outside is not None:  # tokenized by the user: its ids must be the tokenizer's
            stats.skip(INVALID, f"{where}: {outside}")
        elif config.max_tokens is not None and len(row) > config.max_tokens:
            stats.skip("over max_tokens", f"{where}: {len(row)} tokens, more than max_tokens={config.max_tokens}")
        elif not row.num_targets:
            stats.skip("nothing trained", f"{where}: no token of the record is trained")
        else:
            units.append([row])
    tokens = sum(len(u[0]) for u in units)
    stats.trees, stats.rows, stats.row_tokens = stats.trees + len(units), stats.rows + len(units), \
        stats.row_tokens + tokens
    stats.n_pass_tokens, stats.one_pass_tokens = stats.n_pass_tokens + tokens, stats.one_pass_tokens + tokens
    stats.token_ratio = token_ratio(stats.n_pass_tokens, stats.one_pass_tokens)
    return units


def _outside_vocab(row: Layout, vocab_size: int) -> str | None:
    """What of a tokenized record's row is no id of a vocabulary of ``vocab_size`` (its input ids, or the
    labels it trains), or None."""
    targets = row.targets[row.targets != IGNORE]
    for name, ids in (("input_ids", row.input_ids), ("labels", targets)):
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if len(bad):
            return f"{name} holds {int(bad[0])}, outside the tokenizer's vocabulary of {vocab_size}"
    return None


def unit_keys(units: Sequence[Unit]) -> list[Key | None]:
    """The prefix key of each unit's first tree (:func:`onepass.layout.share.prefix_key`): what the order of a
    step sorts by, so that conversations sharing a prefix land in one micro-batch."""
    return [prefix_key(u[0]) for u in units]


def compact_vocab(*datas: TrainData) -> tuple[list[TrainData], np.ndarray]:
    """Renumber the token ids that occur (inputs and targets, all datasets) to 0..V-1.

    The same map for every dataset, so one tiny model serves train and eval;
    ``used[i]`` is the original id of new id ``i``.
    """
    used = used_ids(layout_ids(x for d in datas for u in d.units for x in u))
    # keys: equal prefixes stay equal
    out = [dataclasses.replace(d, units=[[remap_layout(x, used) for x in u] for u in d.units]) for d in datas]
    return out, used


def units_digest(data: TrainData) -> str:
    """A digest of the rows as loaded, unit by unit (every column, in order): what each step trains on.

    Compared between the processes of a run before its first step (two ranks given different data
    files, or the same file rendered by another tokenizer, would train inconsistent steps or wait for
    each other forever) and kept in a checkpoint's fingerprint, so a resume that would train other rows
    is refused. blake2b over the arrays' bytes: 0.4 GB/s on a loaded CPU core (0.4 GB of rows in 1 s).
    """
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    h.update(f"{data.kind}:{data.num_units}".encode())
    for unit in data.units:
        h.update(len(unit).to_bytes(4, "little"))
        for layout in unit:
            for column in ROW_COLUMNS:
                values = np.ascontiguousarray(getattr(layout, column))
                h.update(len(values).to_bytes(8, "little"))
                h.update(memoryview(values).cast("B"))
    return "blake2b:" + h.hexdigest()


def rows_setting(config: TrainConfig, data: TrainData, key: str, say: Any) -> str:
    """A data setting as the run really has it: prepared rows keep the ``schedule`` / ``weighting`` they
    were prepared with (``stats.json``), whatever the config says; a config that says otherwise is named
    (it used to be recorded as the run's, so an n-pass folder was reported as trained one-pass)."""
    asked = str(getattr(config.data_config, key))
    had = data.stats.get(key) if data.kind == "row" else None
    if not isinstance(had, str) or had == asked:
        return asked
    say(f"note: {data.source} holds rows prepared with {key} {had}; the {key} setting ({asked}) applies to "
        "conversations, not to prepared rows")
    return had


def check_same_units(accelerator: Any, config: TrainConfig, data: TrainData, rows: dict[str, str | None]) -> None:
    """Every process read the same rows (:func:`~onepass.train.run.data.units_digest`), else one line on each: two
    ranks given different data files (a node-local path, a file being rewritten) would train inconsistent steps,
    or, with different step counts, wait for each other forever."""
    if accelerator.num_processes == 1:
        return
    from accelerate.utils import gather_object

    seen = gather_object([(accelerator.process_index, data.num_units, rows["rows"], rows["eval_rows"])])
    rank0 = seen[0]
    other = next((s for s in seen if s[2:] != rank0[2:]), None)
    if other is not None:
        which, spec = ("training", config.data) if other[2] != rank0[2] else ("eval", config.eval_data)
        raise TrainConfigError(f"the processes read different {which} data from {spec}: rank 0 has {rank0[1]} "
                               f"{data.kind}s, rank {other[0]} has {other[1]} (or as many with other content); give "
                               "every process the same files (a shared folder), prepared once")


# ---------------------------------------------------------------------------------------------
# order


def units_per_step(config: TrainConfig, world: int) -> int:
    return config.per_device_train_batch_size * config.gradient_accumulation_steps * world


def steps_per_epoch(num_units: int, per_step: int) -> int:
    return math.ceil(num_units / per_step)


def total_steps(config: TrainConfig, num_units: int, world: int) -> int:
    if config.max_steps is not None:
        return config.max_steps
    return max(1, math.ceil(config.num_train_epochs * steps_per_epoch(num_units, units_per_step(config, world))))


def epoch_order(num_units: int, *, seed: int, epoch: int) -> np.ndarray:
    """The seeded shuffle of epoch ``epoch``: a function of (seed, epoch) only."""
    return np.random.default_rng([seed, epoch]).permutation(num_units)


def step_units(num_units: int, step: int, *, seed: int, per_step: int, keys: Sequence[Key | None] | None = None,
               window: int | None = None) -> np.ndarray:
    """Unit indices of optimizer step ``step`` (0-based, counting across epochs).

    ``keys`` (sharing prefixes, :attr:`TrainData.keys`): the epoch's shuffle is then sorted by prefix
    within windows of ``window`` units (default ``per_step``: each step holds the units it holds without
    sharing, only their order, so which of them share a micro-batch, changes: :func:`shared_order`).
    """
    per_epoch = steps_per_epoch(num_units, per_step)
    epoch, i = divmod(step, per_epoch)
    order = epoch_order(num_units, seed=seed, epoch=epoch)
    if keys is not None:
        order = shared_order(order, keys, window or per_step)
    return order[i * per_step:(i + 1) * per_step]


def shared_order(order: np.ndarray, keys: Sequence[Key | None], window: int) -> np.ndarray:
    """``order`` cut into windows of ``window`` consecutive units, each sorted by its units' prefix keys
    (stable; units without a key last), so units that share a prefix are neighbours and fill one
    micro-batch. With ``window`` equal to a step's units, every step trains the same units.

    >>> shared_order(np.array([3, 0, 2, 1]), [(1,), (2,), (1,), None], 2).tolist()
    [0, 3, 2, 1]
    """
    out = order.copy()
    for a in range(0, len(order), window):
        chunk = order[a:a + window].tolist()
        out[a:a + window] = sorted(chunk, key=lambda u: (keys[u] is None, keys[u] or ()))
    return out


def rank_slots(units: np.ndarray, *, rank: int, world: int, batch_size: int, grad_accum: int
               ) -> list[np.ndarray]:
    """This rank's ``grad_accum`` micro-batches of a step's units (some may be empty at the end)."""
    out = []
    for micro in range(grad_accum):
        slot = micro * world + rank
        out.append(units[slot * batch_size:(slot + 1) * batch_size])
    return out


# ---------------------------------------------------------------------------------------------
# rows and batches


def micro_batch_rows(data: TrainData, indices: Sequence[int], *, pack: bool, max_tokens: int | None
                     ) -> list[Layout]:
    """The rows of one micro-batch: its units' trees, packed into rows of ``max_tokens`` if ``pack``;
    with :attr:`TrainData.keys` (sharing prefixes), trees of units that share a prefix merged first
    (:func:`onepass.layout.share.share_rows`: the same loss terms, the prefix computed once per row)."""
    layouts = [x for i in indices for x in data.units[int(i)]]
    if pack and layouts:
        assert max_tokens is not None
        if data.keys is not None:
            return share_rows(layouts, [int(i) for i in indices for _ in data.units[int(i)]], max_tokens)
        return pack_layouts(layouts, max_tokens)
    return layouts


def forward_groups(rows: Sequence[Layout], max_batch_tokens: int | None) -> list[list[Layout]]:
    """Rows grouped into forward passes of at most ``max_batch_tokens`` padded tokens (B * L_max).

    Longest first, so rows of similar length share a pass (little padding). A row
    longer than the budget gets a pass of its own. ``None``: one pass for all rows.
    """
    if not rows:
        return []
    if max_batch_tokens is None:
        return [list(rows)]
    groups: list[list[Layout]] = []
    for row in sorted(rows, key=len, reverse=True):
        if groups and (len(groups[-1]) + 1) * len(groups[-1][0]) <= max_batch_tokens:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def batch_cap_note(max_batch_tokens: int | None, units: Sequence[Unit], *, packed_to: int | None = None) -> str | None:
    """What :func:`forward_groups` cannot keep under ``max_batch_tokens``, in one line, or None: a row is never
    split, so a tree longer than the cap (or, packed into rows of up to ``packed_to`` tokens, a row) is a
    forward pass of its own, over it. Said once when the data is loaded: a cap that cannot hold is not silent.

    >>> tree = empty_row()
    >>> batch_cap_note(4, [[tree]]) is None
    True
    """
    if max_batch_tokens is None:
        return None
    lengths = [len(x) for unit in units for x in unit]
    over = [n for n in lengths if n > max_batch_tokens]
    if over:
        return (f"max_batch_tokens={max_batch_tokens} cannot hold {len(over)} of {len(lengths)} trees (the longest "
                f"{max(over)} tokens): a row is never split, so each is a forward pass of its own, over the cap; "
                f"set max_batch_tokens >= {max(over)} to keep every pass under it")
    if packed_to is not None and packed_to > max_batch_tokens:
        return (f"max_batch_tokens={max_batch_tokens} is below max_tokens={packed_to}: a packed row of more than "
                f"{max_batch_tokens} tokens is never split, so it is a forward pass of its own, over the cap")
    return None


def empty_row() -> Layout:
    """A one-token row with nothing to train (weight 0): keeps a rank in step when it has no data."""
    return row_from_columns({"input_ids": [0], "position_ids": [0], "kv_end": [1], "targets": [0], "weights": [0]})


# ---------------------------------------------------------------------------------------------
# a rank's forward passes


def _rank_passes(data: TrainData, units: Sequence[int], config: TrainConfig, *, rank: int, world: int
                 ) -> list[list[Layout]]:
    """Forward passes (lists of rows) of ``rank`` for the step holding ``units``."""
    passes: list[list[Layout]] = []
    for slot in rank_slots(units, rank=rank, world=world, batch_size=config.per_device_train_batch_size,
                           grad_accum=config.gradient_accumulation_steps):
        rows = micro_batch_rows(data, slot, pack=config.data_config.pack, max_tokens=config.data_config.max_tokens)
        passes.extend(forward_groups(rows, config.max_batch_tokens))
    return passes


def step_passes(data: TrainData, units: Sequence[int], config: TrainConfig, *, rank: int, world: int,
                even: bool = False) -> tuple[list[list[Layout]], int]:
    """This rank's forward passes for one step, and how many of them hold data (they come first).

    A rank without data (the last step of an epoch) runs one zero-weight row, so every
    process joins the gradient all-reduce. ``even`` (FSDP / DeepSpeed, which gather
    parameters in every forward): every rank runs as many passes as the busiest one.
    """
    passes = _rank_passes(data, units, config, rank=rank, world=world)
    most = max(len(_rank_passes(data, units, config, rank=r, world=world)) for r in range(world)) if even else 1
    return passes + [[empty_row()] for _ in range(most - len(passes))], len(passes)


def forward_lengths(data: TrainData, config: TrainConfig, steps: Sequence[int], *, rank: int, world: int,
                    even: bool = False, eval_data: TrainData | None = None) -> list[int]:
    """The tokens of every forward pass ``rank`` runs in ``steps`` (and over ``eval_data``), its rows side by side:
    what the run's length buckets are chosen from (:func:`onepass.layout.buckets.length_buckets`)."""
    per_step = units_per_step(config, world)
    lengths = []
    for step in steps:
        units = step_units(data.num_units, step, seed=config.seed, per_step=per_step, keys=data.keys,
                           window=config.data_config.share_window)
        lengths += [sum(len(r) for r in rows) for rows in step_passes(data, units, config, rank=rank, world=world,
                                                                      even=even)[0]]
    if eval_data is not None:
        lengths += [sum(len(r) for r in rows) for rows in eval_passes(eval_data, config, rank=rank, world=world,
                                                                      even=even)]
    return lengths


def eval_passes(data: TrainData, config: TrainConfig, *, rank: int, world: int, even: bool = False
                ) -> list[list[Layout]]:
    """This rank's forward passes over the whole of ``data``: every world-th unit, in micro-batches.

    No step, so no zero-weight row for a rank without data (a forward of an unwrapped model
    joins no collective); ``even`` (sharded models, which gather parameters in every forward):
    zero-weight rows up to the busiest rank's number of passes.
    """
    def passes(r: int) -> list[list[Layout]]:
        mine = list(range(r, data.num_units, world))
        out: list[list[Layout]] = []
        for start in range(0, len(mine), config.per_device_train_batch_size):
            rows = micro_batch_rows(data, mine[start:start + config.per_device_train_batch_size],
                                    pack=config.data_config.pack,
                                    max_tokens=config.data_config.max_tokens)
            out.extend(forward_groups(rows, config.max_batch_tokens))
        return out

    todo = passes(rank)
    if even:
        todo += [[empty_row()]] * (max(len(passes(r)) for r in range(world)) - len(todo))
    return todo
