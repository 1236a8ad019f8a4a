"""The work of the serving loop's step boundaries, which :class:`~.serve_loop.EngineLoop` inherits:
prompt chunks (prefill), the batched verify step, and each request's bookkeeping as its tokens
commit or it ends.

This is half of one class, not a second engine: the methods run on the loop's state (slots,
cache, drafters, controller, static steps, ``exact``), which :class:`~.serve_loop.EngineLoop`
builds and documents; :mod:`.serve_loop`'s docstring gives the order of a boundary's work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..hostcopy import device_ints
from ..models.base import ForwardOut
from ..models.graphed_batch import GraphedBatch, GraphedPrefill
from ..models.invariant_linear import row_counts
from ..sampling import make_generator, probs_from_logits_rows, sample_one
from .acceptance import accept_greedy_rows, accept_sampled_rows
from .batch import forward_ragged
from .requests import Event, ema_acceptance

SPAN_BUCKET_MIN = 256  # the smallest span a static step attends over with span buckets
SHAPE_CHECKS = 2  # exact: steps of a shape other than the full one compared with it before it is trusted

ALPHA_EMA = 0.3  # weight of the newest step in a slot's acceptance estimate
LOOP_ALPHA_EMA = 0.1  # and in the loop's (all slots), a new request's prior
RELAX = 0.3  # a step without drafts moves a slot's estimate this far towards the loop's (Slot.relax)


@dataclass
class _Row:
    """One slot's row of a verify step."""

    s: int
    drafts: torch.Tensor  # [k_r]
    probs: torch.Tensor | None  # [k_r, V] or None (argmax drafts)
    asked: int = 0  # drafts asked of the drafter (k_r <= asked)


class SlotWork:
    """Prefill, verify and per-request bookkeeping of :class:`~.serve_loop.EngineLoop` (engine thread)."""

    def _prefill(self) -> None:
        """One chunk of every prompt still being prefilled: each alone with ``exact``, else in one
        forward (see below for the exception)."""
        todo = [s for s in range(self.max_slots) if self._slots[s] is not None and not self._slots[s].out]
        if not todo:
            return
        chunk = self.prefill_chunk
        if self.exact:
            for s in todo:
                self._prefill_alone(s)
            return
        width = max(min(chunk, self._slots[s].prompt.numel() - self._slots[s].length) for s in todo)
        # a row is padded to the widest chunk; one whose padding would run past its cache rows
        # (a prompt ending near the context limit) runs alone, unpadded
        fits = [s for s in todo if self._slots[s].length + width <= self.cache.max_len]
        for group in [fits] + [[s] for s in todo if s not in fits]:
            if group:
                self._prefill_rows(group, chunk)

    def _prefill_alone(self, s: int) -> None:
        """Advance slot ``s``'s prompt by up to ``prefill_chunk`` positions in forwards whose shapes
        depend on this prompt only: static ``[1, static_prefill_chunk]`` steps for a short prompt,
        else one eager forward of the prompt's next ``prefill_chunk`` tokens."""
        slot, c = self._slots[s], self.static_prefill_chunk
        n = slot.prompt.numel()
        if n > self.static_prefill_max or -(-n // c) * c > self.cache.max_len:
            self._prefill_rows([s], self.prefill_chunk)
            return
        for _ in range(max(1, self.prefill_chunk // c)):
            seg = slot.prompt[slot.length: slot.length + c]
            span = self._span(slot.length + c)
            step = self._prefill_steps.get(span)
            if step is None:
                step = self._prefill_steps[span] = GraphedPrefill(self.model, self.cache, c, self.capture, span=span,
                                                                  span_invariant=self.span_buckets)
            try:
                out = step(seg, s, slot.length)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                if self._sync is not None:  # under tensor parallelism the ranks may disagree now: end the loop
                    raise
                self._fail(s, e)
                return
            if self._prefilled(s, 0, seg.numel(), out):
                return

    def _prefill_rows(self, group: list[int], chunk: int) -> None:
        slots = [self._slots[s] for s in group]
        segs = [sl.prompt[sl.length: sl.length + chunk] for sl in slots]
        try:
            out = forward_ragged(self.model, self.cache, segs, [sl.length for sl in slots], group, self.capture)
        except Exception as e:  # noqa: BLE001 - these requests fail, the running ones go on
            if self._sync is not None:
                raise
            for s in group:
                self._fail(s, e)
            return
        for r, s in enumerate(group):
            self._prefilled(s, r, segs[r].numel(), out)

    def _accept_sampled(self, rows: list[_Row], sampled: list[int], n_drafts: list[int], drafts: torch.Tensor,
                        logits: torch.Tensor) -> torch.Tensor:
        """Rejection sampling for the step's sampled rows in one batched call (``[len(sampled),
        width + 1]``); each row draws its ``2n + 1`` uniforms from its own generator, so its tokens
        do not depend on the other rows."""
        dev = logits.device
        idx = device_ints(sampled, dev)
        d = drafts[idx]
        k = d.shape[1]
        slots = [self._slots[rows[i].s] for i in sampled]
        probs = probs_from_logits_rows(logits[idx], [slot.req.params for slot in slots])
        q = None
        if any(rows[i].probs is not None for i in sampled):
            q = torch.zeros(d.shape + (logits.shape[-1],), device=dev).scatter_(2, d[..., None], 1.0)
            for j, i in enumerate(sampled):
                if rows[i].probs is not None:
                    q[j, : n_drafts[i]] = rows[i].probs
        # one draw per row (the row's own stream), padded to 2k + 1 by a spare row dropped after
        u = [torch.rand(2 * n_drafts[i] + 1, device=dev, generator=slot.gen) for i, slot in zip(sampled, slots)]
        u = torch.nn.utils.rnn.pad_sequence(u + [torch.zeros(2 * k + 1, device=dev)], batch_first=True)[:-1]
        n = device_ints([n_drafts[i] for i in sampled], dev)
        return accept_sampled_rows(d, n, q, probs, u)

    def _drafted(self, prop, ks: int):
        """A proposal's drafts (at most ``ks``, where the drafter left them) and their probabilities."""
        drafts = prop.tokens.reshape(-1)[:ks]
        return drafts, None if prop.probs is None else prop.probs[: drafts.numel()]

    def _slot_drafter(self, s: int):
        """Slot ``s``'s drafter. A built-in drafter (made by ``spawn``) is spawned at the slot's first
        request and kept, started afresh by ``begin`` for each request: a DFlash drafter keeps its
        context buffers and its captured block, one graph capture per slot instead of per request.
        A drafter factory gets called for every request; a request that fails drops its drafter."""
        if not self._reuse_drafters:
            return self._spawn()
        d = self._slot_drafters.get(s)
        if d is None:
            d = self._slot_drafters[s] = self._spawn()
        return d

    def _span(self, need: int) -> int:
        """The span a static step needing positions ``0 .. need-1`` attends over: the whole cache, or
        with span buckets the smallest of 256, 512, 1024, ... that holds them (at most the cache)."""
        top = self.cache.max_len
        if not self.span_buckets:
            return top
        span = SPAN_BUCKET_MIN
        while span < need:
            span *= 2
        return min(span, top)

    def _prefilled(self, s: int, r: int, m: int, out: ForwardOut) -> bool:
        """Slot ``s`` ran ``m`` prompt positions as row ``r`` of ``out`` (logits: its last one's).
        At the prompt's end, its first token and its drafter's ``begin``. True when the prompt is
        done (or the request failed)."""
        slot, dev = self._slots[s], self.model.device
        keep = self._spawn is not None  # only a drafter reads the prompt rows
        if keep:
            slot.rows_h.append(out.hidden[r, :m])
            if out.captured is not None:
                slot.rows_c.append(out.captured[r, :m])
        slot.length += m
        if slot.length < slot.prompt.numel():
            return False
        try:
            p = slot.req.params
            slot.gen = None if p.greedy else make_generator(slot.seed, dev)
            first = sample_one(out.logits[r], p, slot.gen)
            if keep:
                rows = ForwardOut(out.logits[r: r + 1], torch.cat(slot.rows_h),
                                  torch.cat(slot.rows_c) if slot.rows_c else None)
                if self._all_slots is not None:  # one drafter for every slot
                    self._all_slots.begin(s, slot.prompt.to(dev), rows, sampled=not p.greedy)
                    slot.drafter = self._all_slots
                else:
                    slot.drafter = self._slot_drafter(s)
                    slot.drafter.begin(slot.prompt.to(dev), rows)
        except Exception as e:  # noqa: BLE001 - this request fails alone
            self._fail(s, e)
            return True
        slot.rows_h, slot.rows_c = [], []
        slot.ttft_s = time.perf_counter() - slot.t_submit
        self._commit(s, [first])
        return True

    def _step(self, k: int) -> None:
        """One verify step over every active slot, drafting ``k`` (see the module docstring)."""
        t0 = time.perf_counter()
        dev = self.model.device
        active = [s for s in range(self.max_slots) if self._slots[s] is not None and self._slots[s].out]
        if not active:
            return
        rows: list[_Row] = []
        together: list[tuple[_Row, tuple]] = []  # rows the all-slots drafter proposes for, in one step
        # a row's drafts until its drafter proposes: a host-token drafter's are a list (no torch call
        # per slot: each can hand the GIL to a woken client thread, see _deliver), others' a tensor
        no_drafts: list[int] = []
        for s in active:
            slot = self._slots[s]
            p = slot.req.params
            # a seeded sampled request drafts a fixed k: its random stream (one draw per draft) must not
            # depend on the controller's timing, so the same seed gives the same tokens
            ks = self.kmax if p.seed is not None and not p.greedy else k
            ks = max(0, min(ks, slot.req.max_new_tokens - len(slot.out)))
            try:
                row = _Row(s, no_drafts, None, ks if slot.drafter is not None else 0)
                if slot.drafter is not None and ks > 0:
                    if slot.drafter is self._all_slots:
                        together.append((row, (s, slot.last, ks, p, slot.gen)))
                    elif getattr(slot.drafter, "host_tokens", False):
                        row.drafts = slot.drafter.propose_ids(slot.last, ks)[:ks]
                    else:
                        row.drafts, row.probs = self._drafted(slot.drafter.propose(slot.last, ks, p, slot.gen), ks)
                rows.append(row)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                self._fail(s, e)
        block = None  # every row's drafts in one tensor (the all-slots drafter, greedy rows only)
        if together:
            try:
                if len(together) == len(rows) and all(a[3].greedy for _, a in together):
                    block, n_block = self._all_slots.propose_greedy([a for _, a in together])
                else:
                    for (row, (_, _, ks, _, _)), prop in zip(together, self._all_slots.propose([a for _, a in together])):
                        row.drafts, row.probs = self._drafted(prop, ks)
            except Exception as e:  # noqa: BLE001 - these requests fail, the others go on
                if self._sync is not None:
                    raise
                failed = {row.s for row, _ in together}
                for s in failed:
                    self._fail(s, e)
                rows = [r for r in rows if r.s not in failed]
        if not rows:
            return
        n_drafts = [len(r.drafts) for r in rows] if block is None else n_block
        # static steps: every row padded to kmax + 1 (one shape: a row's bits never depend on the
        # other rows); with the controller, width 1 when nothing is drafted (a second graph: k = 0
        # then costs a plain step, so the controller can fall back). With exact, only while the
        # steps of other shapes have given rows the bits of the full one (checked, _verify);
        # without exact always, a row's bits then depending on the width the step ran
        if not self.static_steps:
            width = 1 + max(n_drafts)
        elif self.controller is not None and not any(n_drafts) and (not self.exact or self._other_shapes()):
            width = 1
        else:
            width = 1 + self.kmax
        ids = self._step_ids(rows, block, width)
        drafts = ids[:, 1:]
        lengths = [self._slots[r.s].length for r in rows]
        greedy = [i for i, r in enumerate(rows) if self._slots[r.s].req.params.greedy]
        sampled = [i for i, r in enumerate(rows) if not self._slots[r.s].req.params.greedy]
        try:
            out = self._verify(rows, ids, lengths, width)
            packed = []
            if greedy:
                g = device_ints(greedy, dev)
                packed.append(accept_greedy_rows(drafts[g], device_ints([n_drafts[i] for i in greedy], dev),
                                                 out.logits[g]).reshape(-1))
            if sampled:
                packed.append(self._accept_sampled(rows, sampled, n_drafts, drafts, out.logits).reshape(-1))
            flat = torch.cat(packed)
            self._deliver()  # the last step's events: the clients run while the GPU works
            flat = flat.tolist()  # the one host sync of the step
        except Exception as e:  # noqa: BLE001 - the step's requests fail, the loop goes on
            if self._sync is not None:
                raise
            for r in rows:
                self._fail(r.s, e)
            return
        res = {i: flat[j * (width + 1):(j + 1) * (width + 1)] for j, i in enumerate(greedy + sampled)}
        # recurrent (linear-attention) layers keep each slot's accepted rows; KV needs nothing
        self.cache.commit([r.s for r in rows], [res[i][0] + 1 for i in range(len(rows))])
        accepted, drafted = 0, 0
        observed: list[tuple[int, torch.Tensor]] = []  # the all-slots drafter's rows, written in one step
        for i, r in enumerate(rows):
            slot, nd = self._slots[r.s], n_drafts[i]
            n, toks, fed = res[i][0], res[i][1:res[i][0] + 2], slot.last  # fed: the row's first input
            slot.length += n + 1  # positions past it hold rejected rows: overwritten next step
            slot.accepted.append(n)
            slot.drafted += nd
            accepted, drafted = accepted + n, drafted + nd
            if r.asked:
                slot.record_drafts(n, r.asked, ALPHA_EMA)
            elif slot.drafter is not None:
                slot.relax(*self._acceptance, RELAX)
            self._acceptance[:] = ema_acceptance(*self._acceptance, n, r.asked, LOOP_ALPHA_EMA)
            if self._commit(r.s, toks) or slot.drafter is None:
                continue
            if slot.drafter is self._all_slots:
                observed.append((r.s, None if out.captured is None else out.captured[i, : n + 1]))
                continue
            try:
                if getattr(slot.drafter, "host_tokens", False):  # the fed tokens, known here: no torch call
                    slot.drafter.observe([fed] + toks[:n], None)
                else:
                    cap = None if out.captured is None else out.captured[i, : n + 1]
                    slot.drafter.observe(ids[i, : n + 1], ForwardOut(out.logits[i, : n + 1], out.hidden[i, : n + 1], cap))
            except Exception as e:  # noqa: BLE001
                self._fail(r.s, e)
        if observed:
            try:
                self._all_slots.observe(observed)
            except Exception as e:  # noqa: BLE001
                if self._sync is not None:
                    raise
                for s, _ in observed:
                    if self._slots[s] is not None:
                        self._fail(s, e)
        dt = time.perf_counter() - t0
        if self.controller is not None:
            self.controller.record(len(rows), k, dt, tokens=len(rows) + accepted)
        with self._cv:
            self._step_s.append(dt)
            self._k_hist[k] += 1
            self._k_seconds[k] += dt
            self._n["steps_total"] += 1
            self._n["accepted_total"] += accepted
            self._n["drafted_total"] += drafted

    def _step_ids(self, rows: list[_Row], block: torch.Tensor | None, width: int) -> torch.Tensor:
        """The step's input ``[b, width]``, row ``i`` ``[last, d_1 .. d_k_i, 0 ..]``: from the all-slots
        drafter's ``block``, or one tensor from host lists (none, n-gram), or padded on the device."""
        dev = self.model.device
        if block is None and all(isinstance(r.drafts, list) for r in rows):
            return device_ints([[self._slots[r.s].last] + r.drafts + [0] * (width - 1 - len(r.drafts)) for r in rows], dev)
        lasts = device_ints([[self._slots[r.s].last] for r in rows], dev)
        if block is None:
            block = torch.nn.utils.rnn.pad_sequence(
                [torch.as_tensor(r.drafts, dtype=torch.int64).to(dev) for r in rows], batch_first=True)
        return torch.cat([lasts, torch.nn.functional.pad(block, (0, width - 1 - block.shape[1]))], dim=1)

    def _verify(self, rows: list[_Row], ids: torch.Tensor, lengths: list[int], width: int) -> ForwardOut:
        """The step's target forward: logits, hidden and captured ``[b, width, ...]``, row ``i``
        being slot ``rows[i].s`` verifying ``ids[i]`` at positions ``lengths[i] ..``."""
        dev, slots = self.model.device, [r.s for r in rows]
        if not self.static_steps:
            return self.model.forward_batch(ids, self.cache, device_ints(lengths, dev),
                                            slots=device_ints(slots, dev), span=max(lengths) + width,
                                            capture=self.capture, logits="all")
        # The step runs the first n slots, n the smallest of 1, 2, 4, ... above every live row's slot
        # (slots are taken lowest first), or all of them. An idle one (free, or a prompt being
        # prefilled) starts at its length, so its dummy writes land past what it has committed
        # (masked, and overwritten by its next forward).
        starts = [self._idle_start if sl is None else sl.length for sl in self._slots]
        n = self._step_rows(max(slots) + 1)
        span = self._span(max(starts[:n]) + width)
        out = self._static_step(n, width, span)(ids, slots, starts[:n])
        if self.exact and (n, width) != (self.max_slots, 1 + self.kmax) and \
                self._checked.get((n, width, span), 0) < SHAPE_CHECKS:
            out = self._check_step(out, ids, slots, starts, (n, width, span))
        if slots == list(range(out.logits.shape[0])):
            return out
        pick = device_ints(slots, dev)
        return ForwardOut(out.logits[pick], out.hidden[pick], None if out.captured is None else out.captured[pick])

    def _other_shapes(self) -> bool:
        """Whether exact steps may take shapes other than the full one (all slots, ``kmax + 1``
        wide): while every such shape checked gave the full one's bits, and not under tensor
        parallelism (the ranks would have to agree on every check)."""
        return self._shapes_exact and self._sync is None

    def _row_buckets(self) -> list[int]:
        """The slot counts a static step may run: 1, 2, 4, ... and all of them, or all only."""
        if not self.slot_buckets or (self.exact and not self._other_shapes()):
            return [self.max_slots]
        return row_counts(self.max_slots)

    def _widths(self) -> list[int]:
        """The widths a static step may run: ``kmax + 1``, and 1 when nothing is drafted with the
        controller (with exact, while other shapes may be taken: see ``_step``)."""
        narrow = self.controller is not None and (not self.exact or self._other_shapes())
        return sorted({1 + self.kmax} | ({1} if narrow else set()))

    def _spans(self) -> list[int]:
        """The spans a static verify step may attend over (one, the whole cache, without span buckets)."""
        w, top = 1 + self.kmax, self.cache.max_len - (1 + self.kmax)
        spans = [self._span(w)]
        while spans[-1] < top and self.span_buckets:
            spans.append(self._span(spans[-1] + w))
        return spans

    def _step_rows(self, need: int) -> int:
        """The slots a static step runs: the smallest bucket holding ``need``."""
        return next(n for n in self._row_buckets() if n >= need)

    def _static_step(self, rows: int, width: int, span: int) -> GraphedBatch:
        step = self._static.get((rows, width, span))
        if step is None:
            step = self._static[(rows, width, span)] = GraphedBatch(
                self.model, self.cache, width, self.capture, span=span, span_invariant=self.span_buckets, rows=rows)
        return step

    def _check_step(self, out: ForwardOut, ids: torch.Tensor, slots: list[int], starts: list[int],
                    shape: tuple[int, int, int]) -> ForwardOut:
        """One of the first ``SHAPE_CHECKS`` exact steps of ``shape`` (rows, width, span) other than
        the full one: the full step (every slot, ``kmax + 1`` wide) runs on the same rows too, after
        it, so that its cache writes are the ones kept. Where every live row has the full step's
        bits (logits, hidden, captured) each time, steps of this shape run alone from then on; else
        no shape but the full one is used in this loop (kernels' results depending on the row
        count: cuBLAS picks kernels by shape). Returns the full step's rows: the bits an exact step
        has either way."""
        w, width = 1 + self.kmax, shape[1]
        full = self._static_step(self.max_slots, w, self._span(max(starts) + w))(
            torch.nn.functional.pad(ids, (0, w - width)), slots, starts)
        pick = device_ints(slots, ids.device)
        pairs = [(out.logits, full.logits), (out.hidden, full.hidden)]
        if out.captured is not None:
            pairs.append((out.captured, full.captured))
        if all(same_bits(a[pick, :width], b[pick, :width]) for a, b in pairs):
            self._checked[shape] = self._checked.get(shape, 0) + 1
        else:
            self._shapes_exact = False
        return ForwardOut(full.logits[:, :width], full.hidden[:, :width],
                          None if full.captured is None else full.captured[:, :width])

    # --- per-request bookkeeping (engine thread) ------------------------------------------
    def _commit(self, s: int, toks: list[int]) -> bool:
        """Emit the committed ``toks`` of slot ``s`` up to a stop id or the token budget (nothing
        after them); True when the request is over (its slot is then free)."""
        slot = self._slots[s]
        emit, reason = [], None
        for t in toks:
            emit.append(t)
            if t in slot.stop:
                reason = "stop"
                break
            if len(slot.out) + len(emit) >= slot.req.max_new_tokens:
                reason = "length"
                break
        slot.out.extend(emit)
        slot.last = emit[-1]
        self._count("tokens_total", len(emit))
        self._outbox.append((slot.handle, Event("tokens", token_ids=emit)))
        if reason is not None:
            self._finish(s, reason)
            return True
        return False

    def _finish(self, s: int, reason: str) -> None:
        slot, self._slots[s] = self._slots[s], None
        if self._all_slots is not None:
            self._all_slots.drop(s)  # its steps may run fewer slots now (DFlashSlots._rows)
        stats = slot.stats()
        self._count("requests_cancelled" if reason == "cancelled" else "requests_finished")
        self._outbox.append((slot.handle, Event("done", finish_reason=reason, stats=stats)))

    def _fail(self, s: int, err) -> None:
        slot, self._slots[s] = self._slots[s], None
        self._slot_drafters.pop(s, None)  # it may have failed mid-way: the slot's next request gets a new one
        if self._all_slots is not None:
            self._all_slots.drop(s)
        self._count("requests_failed")
        self._outbox.append((slot.handle, Event("error", message=err if isinstance(err, str) else describe(err))))

    def _deliver(self) -> None:
        """Send the events the loop has queued (in order). Not at once: a client thread woken
        mid-step takes the GIL whenever the engine thread's next torch call releases it (~45 us a
        woken client on the H200's host: 1.7 ms a step at 32 clients, measured at 2a9188c). They go
        out just before a step's host sync, while the engine waits for the GPU, and when the loop
        runs out of work."""
        box, self._outbox = self._outbox, []
        for handle, ev in box:
            handle._send(ev)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The static steps' shape check (a function, so that a test can make it fail)."""
    return torch.equal(a, b)


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"
