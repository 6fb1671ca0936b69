"""Run-time planning: every rank plans a new mask itself, in milliseconds, and may plan it ahead.

Packed sequences bring a new document mask every batch. ``plan_attention(..., planner="fast")``
(the default for a ``BlockMask``) plans it with ``planner.fast.FastPlanner`` on every rank: the
plan is a pure function of the mask and the configuration, so ranks agree without a broadcast
(``debug=True`` compares the plans' hashes once, naming a rank that differs).

Two paths, neither with a device sync on the step's critical path beyond reading the mask itself:

* At the first attention of the step: the mask's non-empty cells are read (``BlockCells``, O(cells))
  and planned, in milliseconds (``benchmarks/replan.py``).
* Ahead of the step: ``plan_ahead(block_mask)`` (e.g. from the data loader, when the batch is built)
  hands the mask to a worker thread, which reads it (for a mask on a GPU, the copy to the host waits
  there, not in the step) and plans it for every configuration planned before. ``plan_attention``
  then finds the finished plan. It matches on the mask's tensors (the same live tensors, unmodified:
  identity and version counter; the entry keeps them alive, so their memory cannot be reused by
  another mask) or, failing that, on the content of its cells, so a plan made for another mask is
  never used.

All state lives in one ``OnlinePlanner`` object (``ONLINE``): the planners per configuration, the
handed-over masks, the finished plans, the cost models resolved from profiles (each bounded) and the
worker. The worker is a daemon thread, started on the first ``plan_ahead`` and joined at exit
(``atexit``; at most ``JOIN_SECONDS``), so it never keeps a process from exiting.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from ..cache import LRU, process_state
from ..masks.cells import BlockCells
from ..masks.read import read_mask
from ..planner.cost import CostModel
from ..planner.fast import FastPlanner
from ..planner.plan import TilePlan

#: seconds ``shutdown`` waits for the worker at exit (a plan takes milliseconds)
JOIN_SECONDS = 5.0


def _tensor_key(t: Tensor | None) -> tuple | None:
    if t is None:
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), str(t.dtype),
            str(t.device), t._version)


def mask_identity(block_mask: BlockMask) -> tuple:
    """Identity of a BlockMask's content: its index tensors (storage, view, version) and sizes. Equal for the same
    unmodified tensors; valid as long as they are alive (``OnlinePlanner`` keeps the masks it keys alive)."""
    return (tuple(int(x) for x in block_mask.seq_lengths), tuple(int(x) for x in block_mask.BLOCK_SIZE),
            _tensor_key(block_mask.kv_num_blocks), _tensor_key(block_mask.kv_indices),
            _tensor_key(block_mask.full_kv_num_blocks), _tensor_key(block_mask.full_kv_indices))


@dataclass(slots=True)
class _Handed:
    """A mask handed over by ``plan_ahead``: kept alive (its identity is the key), read by the worker."""

    mask: BlockMask
    cells: Future = field(default_factory=Future)
    """Resolves to its ``BlockCells`` (or the reading error)."""
    done: Future = field(default_factory=Future)
    """Resolves to the number of plans the worker made for it."""


@dataclass(slots=True)
class OnlineStats:
    """Counters of the online planner (tests and reports read them)."""

    handed: int = 0
    """Masks handed over by ``plan_ahead``."""
    planned_ahead: int = 0
    """Plans the worker made."""
    used_ahead: int = 0
    """Plans ``plan_attention`` took from the worker (made ahead)."""
    planned_inline: int = 0
    """Plans made at the call (no plan ahead for this mask content)."""
    reread: int = 0
    """Masks read at the call (not handed over, or handed over but modified or freed)."""
    seconds_inline: float = 0.0
    """Time spent planning at the call (the step waits for it), reading masks included."""
    seconds_ahead: float = 0.0
    """Time the worker spent reading and planning handed-over masks (off the step's path)."""


class OnlinePlanner:
    """Planners per configuration, handed-over masks, finished plans and the worker thread (module docstring)."""

    def __init__(self, *, configs: int = 8, masks: int = 4, plans: int = 32):
        self._planners: LRU[tuple, FastPlanner] = LRU(configs)
        self._handed: LRU[tuple, _Handed] = LRU(masks)
        self._plans: LRU[tuple, Future] = LRU(plans)
        self._costs: LRU[tuple, CostModel] = LRU(configs)
        self._lock = threading.RLock()  # one planning at a time (a FastPlanner's caches are not thread-safe)
        self._start_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.stats = OnlineStats()

    # ------------------------------------------------------------------ the step's side
    def planner(self, key: tuple, make: Callable[[], FastPlanner]) -> FastPlanner:
        """The planner of configuration ``key`` (``FastPlanner.key``), made by ``make`` the first time: it keeps
        its caches, and the worker plans handed-over masks for it."""
        hit = self._planners.get(key)
        if hit is None:
            hit = make()
            assert hit.key == key, "the planner's configuration must be the key it is cached under"
            self._planners.put(key, hit)
        return hit

    def cost_model(self, key: tuple, make: Callable[[], object]):
        """The cost model or profile a ``cost=`` argument names (a profile path, ``"auto"``), resolved by ``make`` once
        per ``key``: a step's planning neither reads the profile again nor, for ``"auto"``, meets the other ranks."""
        hit = self._costs.get(key)
        if hit is None:
            hit = make()
            self._costs.put(key, hit)
        return hit

    def cells(self, block_mask: BlockMask) -> BlockCells:
        """The non-empty cells of ``block_mask``: from the worker when it was handed over (same live tensors,
        unmodified), else read now."""
        entry = self._handed.get(mask_identity(block_mask))
        if entry is not None:
            try:
                return entry.cells.result()
            except Exception:  # noqa: BLE001 - the worker could not read it: read (and raise) here
                pass
        self.stats.reread += 1
        t0 = time.perf_counter()
        cells = read_block_cells(block_mask)
        self.stats.seconds_inline += time.perf_counter() - t0
        return cells

    def plan(self, planner: FastPlanner, cells: BlockCells) -> tuple[TilePlan, bool]:
        """(plan of ``cells`` for ``planner``'s configuration, whether it was made ahead)."""
        key = (planner.key, cells.content_hash())
        fut = self._plans.get(key)
        if fut is None and self._busy():
            self._drain()  # the worker may be planning exactly this mask: wait rather than plan it twice
            fut = self._plans.get(key)
        if fut is not None:
            try:
                tp = fut.result()
                self.stats.used_ahead += 1
                return tp, True
            except Exception:  # noqa: BLE001 - plan again here, so the error surfaces in the step
                pass
        t0 = time.perf_counter()
        with self._lock:
            tp = planner.plan(cells)
        self.stats.seconds_inline += time.perf_counter() - t0
        done: Future = Future()
        done.set_result(tp)
        self._plans.put(key, done)
        self.stats.planned_inline += 1
        return tp, False

    # ------------------------------------------------------------------ the worker
    def hand_over(self, block_mask: BlockMask) -> Future:
        """Read ``block_mask`` and plan it for every known configuration on the worker thread; the returned
        future resolves to the number of plans made."""
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"`block_mask` must be a torch.nn.attention.flex_attention.BlockMask, got "
                            f"{type(block_mask).__name__}")
        ident = mask_identity(block_mask)
        entry = self._handed.get(ident)
        if entry is not None:
            return entry.done
        entry = _Handed(mask=block_mask)
        self._handed.put(ident, entry)
        self.stats.handed += 1
        self._start()
        self._queue.put(entry)
        return entry.done

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._work, name="ultraattn-plan-ahead", daemon=True)
                self._thread.start()

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                entry = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                if entry is None:
                    return
                self._plan_entry(entry)
            finally:
                self._queue.task_done()

    def _plan_entry(self, entry: _Handed) -> None:
        t0 = time.perf_counter()
        try:
            self._read_and_plan(entry)
        finally:
            self.stats.seconds_ahead += time.perf_counter() - t0

    def _read_and_plan(self, entry: _Handed) -> None:
        try:
            cells = read_block_cells(entry.mask)
        except Exception as exc:  # noqa: BLE001 - reported to whoever asks for this mask
            entry.cells.set_exception(exc)
            entry.done.set_exception(exc)
            return
        entry.cells.set_result(cells)
        made = 0
        for planner in self._planners.values():
            if planner.shape.seq_len != cells.q_len or self._stop.is_set():
                continue
            key = (planner.key, cells.content_hash())
            if self._plans.get(key) is not None:
                continue
            fut: Future = Future()
            self._plans.put(key, fut)
            try:
                with self._lock:
                    fut.set_result(planner.plan(cells))
                made += 1
            except Exception as exc:  # noqa: BLE001 - the call plans again and raises there
                fut.set_exception(exc)
        self.stats.planned_ahead += made
        entry.done.set_result(made)

    def _busy(self) -> bool:
        return self._queue.unfinished_tasks > 0

    def _drain(self) -> None:
        """Wait until the worker has processed every mask handed over so far."""
        while self._busy() and self._thread is not None and self._thread.is_alive():
            time.sleep(0.0005)

    def shutdown(self, timeout: float = JOIN_SECONDS) -> None:
        """Stop and join the worker (the exit handler calls this; ``plan_ahead`` restarts it)."""
        self._stop.set()
        t = self._thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            self._queue.put(None)
            t.join(timeout)
        self._thread = None

    def clear(self) -> None:
        """Forget planners, handed-over masks and plans (tests)."""
        self.shutdown()
        self._planners.clear()
        self._handed.clear()
        self._plans.clear()
        self.stats = OnlineStats()


ONLINE = process_state("runtime: the online planner", OnlinePlanner())
"""The process's online planner (one object holds all run-time planning state)."""
atexit.register(ONLINE.shutdown)


def plan_ahead(block_mask: BlockMask) -> Future:
    """Hand ``block_mask`` over early (e.g. from the data loader): a worker thread reads it and plans it for every
    attention configuration ``plan_attention`` has planned with the fast planner before, while the previous step
    runs. The step's ``plan_attention`` (or a compiled site) then takes the finished plan; without this call the
    plan is made there, in milliseconds. Neither path waits for the device in the step.

    Returns:
        A future resolving to the number of plans made (results are picked up by ``plan_attention``; waiting on
        the future is never needed).

    Raises:
        TypeError: ``block_mask`` is not a ``BlockMask``.
    """
    return ONLINE.hand_over(block_mask)


def read_block_cells(block_mask: BlockMask) -> BlockCells:
    """A BlockMask's non-empty cells, read as ``plan_attention`` reads it (``masks.read.read_mask``, sparse)."""
    return read_mask(block_mask, q_len=None, sparse=True).cells
