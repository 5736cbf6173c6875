"""The request-level API of ``Engine``: submit requests as they come, step, stream, abort.

    rid = engine.submit(prompt_ids, max_new_tokens=64, logprobs=2)
    for out in engine.stream():          # or: while engine.has_unfinished(): engine.step()
        print(out.request_id, out.token_ids, out.finished)
    engine.abort(rid)

Each request keeps its own sampling parameters, stop token ids, stop strings (matched as
transformers' ``StopStringCriteria`` matches them: the criterion itself runs on the request's
ids) and ``logprobs``. The scheduler persists across steps, so requests arrive while others run.

Lockstep under torchrun: every rank calls ``step`` (or iterates ``stream``) in step with the
others; ``submit`` and ``abort`` take effect at the next step boundary, and there rank 0's
decisions are broadcast and applied on every rank (the other ranks' own calls are ignored; they
learn the request ids from rank 0), so all schedulers decide the same. A step that raises on
one rank only leaves the others waiting in a collective until the process group's timeout: the
job cannot go on (README says how to shorten the wait).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from torch_cp.engine import logprobs
from torch_cp.engine.checks import changed_model_problems
from torch_cp.engine.feedback import warn_ignored_sampling, warn_past_positions
from torch_cp.engine.options import Each, Options
from torch_cp.engine.requests import (
    Request,
    RequestOutput,
    check_request,
    logprobs_problem,
    token_ids_of,
    vocab_size,
)
from torch_cp.engine.sampling import SamplingParams
from torch_cp.engine.scheduler import Scheduler
from torch_cp.engine.stops import IDLE_KEPT, StopStrings, stops_of
from torch_cp.values import as_int


class Serving:
    """``submit`` / ``step`` / ``stream`` / ``abort`` (mixed into ``Engine``)."""

    def _serving_init(self) -> None:
        self._scheduler: Scheduler | None = None
        self._options: dict[int, Options] = {}
        self._stop_strings = StopStrings()
        self._pending: list[tuple] = []  # ("submit", id, prompt, new, options) / ("abort", id)
        self._next_id = 0
        self._outputs: list[RequestOutput] = []
        self._undelivered: deque[RequestOutput] = deque()  # a stream's consumer stopped early

    def submit(self, prompt: Sequence[int], max_new_tokens: int = 16,
               sampling: SamplingParams | None = None,
               stop_token_ids: int | Sequence[int] | None = (),
               stop_strings: str | Sequence[str] | None = (), tokenizer=None,
               logprobs: int | None = None, *, warn: bool = True) -> int:
        """Queue a request (token ids) for the next step; returns its id. A bad request (see
        ``check_request``) ends at that step with ``finish_reason="error"``; bad options raise a
        ValueError naming each, and nothing is queued. Stop strings need ``tokenizer``; a str
        is one stop string and an int one stop token id (as transformers takes them). The
        model's EOS ends a request only as one of its ``stop_token_ids`` (``finish_reason``
        ``"stop"``; ``generate(stream=True)`` passes them). Warns as ``run`` does (top_k or
        top_p at temperature 0, a request past the model's positions) unless ``warn=False`` (a
        caller that warned for the whole batch). ``max_new_tokens``: the most tokens to
        generate; ``sampling``: a ``SamplingParams`` (None: greedy); ``logprobs=k``: each new
        token's log-probability and the k most likely tokens' (``RequestOutput.logprobs``)."""
        problems = changed_model_problems(self.model, self.runtime)
        stop_token_ids, stop_strings = stops_of(stop_token_ids, stop_strings, tokenizer, problems)
        token_ids = token_ids_of(prompt)
        if token_ids is None:
            problems.append(f"prompt must be a sequence of token ids (ints), got "
                            f"{type(prompt).__name__}")
        if as_int(max_new_tokens) is None:  # NumPy's ints too, as Engine.run takes them
            problems.append(f"max_new_tokens must be an int, got {max_new_tokens!r}")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            problems.append(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        problem = logprobs_problem(logprobs, vocab_size(self.model))
        if problem:
            problems.append(problem)
        if problems:
            raise ValueError("invalid request: " + "; ".join(problems))
        if warn:  # the warnings run() gives
            warn_ignored_sampling(sampling or SamplingParams())
            warn_past_positions(self.model, [Request(self._next_id, token_ids,
                                                     as_int(max_new_tokens))])
        # Another rank's submissions are ignored (rank 0's reach it): it makes no criterion.
        numbers = bool(stop_strings) and self.decides
        stop = self._stop_strings.number(tokenizer, stop_strings) if numbers else None
        options = Options(sampling or SamplingParams(), frozenset(stop_token_ids), stop,
                          None if logprobs is None else as_int(logprobs))
        request_id = self._next_id
        self._next_id += 1
        self._pending.append(("submit", request_id, token_ids,
                              as_int(max_new_tokens), options))
        return request_id

    def abort(self, request_id: int) -> None:
        """End a request at the next step boundary; its pages and state slot return then (a
        step already launched for it may still finish on the device; its token is dropped). An
        id no queued or running request has (finished, unknown) changes nothing, and is not
        kept (helper 119: an idle engine kept each); anything but an integer id is a ValueError."""
        rid = as_int(request_id)  # not True (it would abort request 1: helper 84)
        if rid is None:
            raise ValueError(f"abort takes a request id (an int from submit), got "
                             f"{request_id!r}")
        if rid in self._options or any(op[:2] == ("submit", rid) for op in self._pending):
            self._pending.append(("abort", rid))

    def has_unfinished(self) -> bool:
        """Whether a request is queued or running, or has outputs a ``stream`` consumer left
        undelivered (the next ``step`` returns them first). Under torchrun it is rank 0's answer
        (a collective: call it on every rank, as ``stream`` does), so that every rank steps as
        often as rank 0, whose submissions alone count (outputs another rank's consumer left
        come from that rank's next ``step``)."""
        s = self._scheduler
        local = bool(self._undelivered) or (s is not None and not s.done) or any(
            op[0] == "submit" or op[1] in self._options for op in self._pending)  # live ones
        if not self.broadcast:
            return local
        box = [local]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def step(self) -> list[RequestOutput]:
        """Apply the submissions and aborts (rank 0's), run one step, and return what each
        request it touched produced (requests that ended this step included), after the
        outputs of earlier steps a ``stream`` consumer left undelivered. A model cast, moved
        or patched again since the engine was made is refused first, every request kept."""
        if problems := changed_model_problems(self.model, self.runtime):
            raise ValueError(problems[0])
        if self._scheduler is None:
            self._scheduler = Scheduler(self.allocator, self.max_tokens_per_step, self.max_rows)
        self._outputs = []
        scheduler = self._scheduler
        # From the decisions to the report: whatever raises in between (KeyboardInterrupt too)
        # ends every request, so no page, slot or option outlives its request.
        try:
            self._apply(self._decided())
            if not scheduler.done:
                reused = scheduler.reused_tokens
                prefilled, _, ended = self._step(scheduler, self._sampling_of(),
                                                 self._generators(), frozenset())
                self.prefilled_tokens += prefilled
                self.reused_tokens += scheduler.reused_tokens - reused
                self._report(ended)
            if scheduler.done:
                self._settle_ahead()
        except BaseException as error:
            if self._options and hasattr(error, "add_note"):  # Python 3.11+; otherwise unseen:
                # they vanish from has_unfinished and step
                error.add_note(f"torch_cp: requests {sorted(self._options)} ended with this "
                               f"exception (their pages returned); submit them again")
            scheduler.abort_all()
            self._options.clear()
            self._ahead = self._inflight = None
            raise
        earlier = list(self._undelivered)
        self._undelivered.clear()
        return earlier + self._outputs

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (and a hybrid model's state checkpoints) if no request is
        queued or running: True; else change nothing: False. Weights loaded since
        (``load_state_dict``, ``copy_``, ``assign=True``) empty it by themselves at the next
        ``run`` or idle ``step`` (``engine/weights.py``); call this after changing them another
        way (through ``.data``). Under torchrun, on every rank."""
        if self._scheduler is not None and not self._scheduler.done:
            return False
        self._settle_ahead()
        self.allocator.release_all()
        self._weights.seen()
        return True

    def stream(self) -> Iterator[RequestOutput]:
        """Step until every request has ended, yielding each step's outputs as they come. A
        consumer that stops iterating (``break``, an exception) loses nothing: the outputs
        of that step it did not take come first from the next ``stream`` or ``step``."""
        while True:
            while self._undelivered:
                yield self._undelivered.popleft()
            if not self.has_unfinished():  # every rank: the same collectives in each loop
                return
            self._undelivered.extend(self.step())

    def _decided(self) -> list[tuple]:
        """Rank 0's pending submissions and aborts, on every rank (with the stop-string
        criteria they name that it has not sent before)."""
        pending, self._pending = self._pending, []
        if self.decides and self._scheduler.done and self._weights.changed():
            pending.insert(0, ("reset_prefix_cache",))  # weights loaded since: stale prefixes
        if self.decides and len(self._stop_strings) > IDLE_KEPT:  # it numbers the criteria
            self._stop_strings.forget_idle({o.stop for o in self._options.values()} | {
                op[4].stop for op in pending if op[0] == "submit"})
        changes = self._stop_strings.unsent()
        if self.broadcast:
            box = [(pending, changes)]
            dist.broadcast_object_list(box, src=0)
            pending, changes = box[0]
            if not self.decides:
                self._stop_strings.learn(changes)
            self._next_id = max([self._next_id] + [p[1] + 1 for p in pending if p[0] == "submit"])
        return pending

    def _apply(self, pending: list[tuple]) -> None:
        s = self._scheduler
        capacity = self.allocator.num_pages * self.page_size
        vocab = vocab_size(self.model)
        for op in pending:
            if op[0] == "reset_prefix_cache":
                self.reset_prefix_cache()
            elif op[0] == "submit":
                _, rid, prompt, new, options = op
                error = check_request(prompt, new, vocab, capacity)
                if error:
                    self._outputs.append(RequestOutput(rid, (), True, "error", error=error))
                    continue
                options.generator = options.sampling.generator(rid)
                self._options[rid] = options
                s.add(Request(rid, prompt, new))
            elif op[1] in self._options:
                rid = op[1]
                s.abort(rid)
                del self._options[rid]
                self._outputs.append(RequestOutput(rid, (), True, "abort"))

    def _sampling_of(self) -> Mapping[int, SamplingParams]:
        return Each(self._options, "sampling")

    def _generators(self) -> Mapping[int, torch.Generator]:
        return Each(self._options, "generator")

    def _logprob_rows(self, step) -> None:
        """Take ``step``'s log-probabilities right after its launch, before a step launched
        ahead reuses the logits buffer (``logprobs.take``)."""
        step.logprob_rows = logprobs.take(step, Each(self._options, "logprobs"))

    def _token_logprobs(self) -> dict[int, tuple]:
        """Per request of the step ``_step`` just committed that asked for them: its new token's
        (log-probability, ((token, log-probability) of the k most likely, ...))."""
        if self._committed is None:
            return {}
        launched, tokens = self._committed
        return logprobs.of_tokens(launched, tokens)

    def _report(self, ended) -> None:
        """Outputs of the step ``_step`` just committed: new tokens, stops, finishes."""
        if self._committed is None:  # the backend refused even one token
            for request, reason, error in ended:
                self._options.pop(request.index, None)
                self._outputs.append(RequestOutput(request.index, (), True, reason,
                                                   error=error))
            return
        launched, tokens = self._committed
        finished = {request.index: (request, reason) for request, reason, _ in ended}
        token_logprobs = self._token_logprobs()
        for row in launched.rows:
            rid = row.request
            token = tokens.get(rid)
            request, reason = finished.get(rid, (None, None))
            if token is None:
                if reason is not None:
                    self._finish(rid, (), reason, ())
                continue
            logprobs = (token_logprobs[rid],) if rid in token_logprobs else ()
            # A stop on the last allowed token is a stop, as an EOS there is an EOS.
            if reason in (None, "length") and self._stopped(rid, token, request):
                reason = "stop"
            if reason is None:
                self._outputs.append(RequestOutput(rid, (token,), False, None, logprobs))
            else:
                self._finish(rid, (token,), reason, logprobs)

    def _stopped(self, rid: int, token: int, ended: Request | None) -> bool:
        """Whether ``token`` ends request ``rid`` by a stop token id or string; a running
        request is ended then (its pages return). ``ended``: the request if this step's commit
        already ended it."""
        o = self._options[rid]
        request = ended or self._scheduler.running[rid]
        hit = token in o.stop_token_ids
        if not hit and o.stop is not None:
            stop = self._stop_strings[o.stop]
            # The criterion reads the last maximum_token_len tokens: pass those, not them all.
            n = stop.maximum_token_len
            tail = request.generated[-n:]
            if len(tail) < n:
                tail = request.prompt[-(n - len(tail)):] + tail
            hit = bool(stop(torch.tensor([tail]), None)[0])
        if hit and ended is None:
            self._scheduler.abort(rid)
        return hit

    def _finish(self, rid: int, token_ids, reason: str, logprobs) -> None:
        self._options.pop(rid, None)
        self._outputs.append(RequestOutput(rid, tuple(token_ids), True, reason, logprobs))
