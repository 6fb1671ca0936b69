"""Ranks spawned once that run fuzz cases one after another (the property test feeds them, hypothesis in the test
process draws and shrinks).

``RankPool(world)`` starts ``world`` gloo ranks with ``ultraattn.testing.run_ranks`` (free port, timeouts, a rank's
traceback on failure) on a background thread; each rank runs ``rank_loop``: take a case from its inbox, run it
(``fuzz_case.run_attention``), put the result (or the error, with the number of torch.distributed calls made
before it) in the outbox. ``RankPool.run(case)`` returns every rank's result; ``close()`` stops the ranks, which
destroy the process group and exit. World 1 runs in this process (no process group), through the same code.
"""

from __future__ import annotations

import io
import queue
import threading
import time

import torch
from fuzz_case import run_attention

from ultraattn.testing import CommSpy, RankFailure, run_ranks


def run_one(rank: int, world: int, case: dict, serve=run_attention) -> dict:
    """One case on this rank (``serve(rank, world, case)``, the runtime's attention by default): its result, or
    ``{"error": "Type: message", "comm_calls": [...]}``."""
    spy = CommSpy()
    t0 = time.perf_counter()
    try:
        with spy:
            res = serve(rank, world, case)
    except Exception as exc:  # noqa: BLE001 - every error goes back to the property test, which judges it
        return {"error": f"{type(exc).__name__}: {exc}", "comm_calls": list(spy.calls),
                "seconds": time.perf_counter() - t0}
    res["seconds"] = time.perf_counter() - t0
    return res


def rank_loop(rank: int, world: int, inboxes: list, outbox, serve=run_attention) -> int:
    """Serve cases from ``inboxes[rank]`` with ``serve`` until None; returns how many ran."""
    served = 0
    while True:
        msg = inboxes[rank].get()
        if msg is None:
            return served
        n, case = msg
        buf = io.BytesIO()
        torch.save(run_one(rank, world, case, serve), buf)
        outbox.put((n, rank, buf.getvalue()))
        served += 1


class RankPool:
    """``world`` ranks serving fuzz cases (module docstring)."""

    def __init__(self, world: int, *, session_timeout: float = 3600.0, serve=run_attention) -> None:
        """``serve(rank, world, case)``: what a rank does with a case (a module-level function: the ranks are
        spawned); the runtime's attention by default."""
        self.world, self.serve = world, serve
        self.count = 0
        self.served: list[int] | None = None
        self._failure: BaseException | None = None
        if world == 1:
            return
        ctx = torch.multiprocessing.get_context("spawn")
        self._inboxes = [ctx.Queue() for _ in range(world)]
        self._outbox = ctx.Queue()
        self._thread = threading.Thread(target=self._serve, args=(session_timeout,), daemon=True,
                                        name=f"fuzz-ranks-{world}")
        self._thread.start()

    def _serve(self, timeout: float) -> None:
        try:
            self.served = run_ranks(rank_loop, self.world, args=(self._inboxes, self._outbox, self.serve),
                                    timeout=timeout,
                                    pg_timeout=120)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread by run()/close()
            self._failure = exc

    def run(self, case: dict, timeout: float = 300.0) -> list[dict]:
        """Every rank's result for ``case``, in rank order."""
        assert case["world"] == self.world, (case["world"], self.world)
        self.count += 1
        if self.world == 1:
            return [run_one(0, 1, case, self.serve)]
        if self._failure is not None or not self._thread.is_alive():
            raise RankFailure(f"the {self.world} fuzz ranks are gone: {self._failure}")
        for box in self._inboxes:
            box.put((self.count, case))
        got: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world:
            try:
                n, rank, payload = self._outbox.get(timeout=0.5)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RankFailure(f"the {self.world} fuzz ranks died: {self._failure}") from self._failure
                if time.monotonic() > deadline:
                    self._failure = RankFailure(f"ranks {sorted(set(range(self.world)) - set(got))} did not finish "
                                                f"a case within {timeout:g} s")
                    raise self._failure from None
                continue
            if n == self.count:
                got[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        return [got[r] for r in range(self.world)]

    def close(self, timeout: float = 120.0) -> list[int] | None:
        """Stop the ranks (they destroy the process group and exit); how many cases each served."""
        if self.world == 1:
            return [self.count]
        for box in self._inboxes:
            box.put(None)
        self._thread.join(timeout)
        if self._failure is not None:
            raise self._failure
        if self._thread.is_alive():
            raise RankFailure(f"the {self.world} fuzz ranks did not stop within {timeout:g} s")
        return self.served
