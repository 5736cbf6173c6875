"""``Engine.run``: a whole batch of prompts to their results (mixed into ``Engine``)."""

from __future__ import annotations

from collections.abc import Sequence

from torch_cp.agreement import agree, fingerprint
from torch_cp.engine.checks import checked, flag_problems, model_problems
from torch_cp.engine.feedback import Progress, warn_ignored_sampling, warn_past_positions
from torch_cp.engine.options import Options
from torch_cp.engine.requests import (
    Result,
    id_tuple,
    logprobs_problem,
    make_requests,
    new_tokens_per_request,
    normalize_prompts,
    pad_token_ids,
    token_prompts,
    vocab_size,
    with_text,
)
from torch_cp.engine.sampling import SamplingParams
from torch_cp.engine.scheduler import Scheduler
from torch_cp.values import as_int

GREEDY = SamplingParams()


class BatchRuns:
    """``run`` and ``run_tokens``: submit a batch, step until every request ends, return the
    results in order."""

    def run(self, prompts, max_new_tokens: int | Sequence[int],
            sampling: SamplingParams | None = GREEDY,
            eos_token_ids: int | Sequence[int] | None = (),
            progress: bool = False, *, tokenizer=None, attention_mask=None,
            logprobs: int | None = None) -> list[Result]:
        """Generate for ``prompts``; bad requests get error results, the others complete.

        ``prompts``: every form ``torch_cp.generate`` takes: token ids (a list or ``[L]``
        tensor) or a batch of them; strings or chats (a list of messages, or a list of
        conversations) with ``tokenizer``; a ``BatchEncoding`` / dict with ``input_ids`` and
        ``attention_mask`` (``[L]`` or ``[B, L]``), or ``[B, L]`` ids with ``attention_mask=``
        (padding stripped by the mask). See ``normalize_prompts``. ``tokenizer`` also decodes
        ``Result.text``. ``max_new_tokens``: one int for every prompt, or one per prompt.
        ``sampling``: a ``SamplingParams`` for the whole call (None or the default: greedy).
        ``progress``: one tqdm bar over prompt and generated tokens (rank 0).
        ``logprobs=k``: each ``Result`` carries every generated token's log-probability and the
        k most likely tokens' (``RequestOutput.logprobs``). ``eos_token_ids``: the ids that end
        a request (none by default, unlike ``generate``, which stops at the model's EOS).
        Warns (once a call; Python's default filter shows each calling line's first)
        (``IgnoredSettingWarning``) of top_k / top_p at temperature 0, and
        (``PositionLimitWarning``) of requests past the model's positions (``max_positions``).
        A step that raises (KeyboardInterrupt too) ends the call with that exception, every
        page returned.
        """
        problems = []  # the prompts' named in the run's one gather, on every rank
        token_prompts = checked(problems, normalize_prompts, prompts, tokenizer, attention_mask,
                                pad_token_ids(self.model, tokenizer))
        return self._run_checked(token_prompts, problems, max_new_tokens, sampling,
                                 eos_token_ids, progress, tokenizer, logprobs)

    def run_tokens(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                   sampling: SamplingParams | None = GREEDY, eos_token_ids: Sequence[int] = (),
                   progress: bool = False, tokenizer=None, logprobs: int | None = None
                   ) -> list[Result]:
        """``run`` for prompts already normalized to token-id lists (no padding checks): a
        prompt that is not one (floats, bools, a str, nested lists) is a ValueError, as
        ``run``'s."""
        problems = []  # named in the run's one gather, on every rank
        ids = checked(problems, token_prompts, prompts)
        return self._run_checked(ids, problems, max_new_tokens, sampling, eos_token_ids,
                                 progress, tokenizer, logprobs)

    def _run_checked(self, prompts: Sequence[Sequence[int]] | None, problems: list[str],
                     max_new_tokens, sampling: SamplingParams | None,
                     eos_token_ids: Sequence[int], progress: bool, tokenizer,
                     logprobs: int | None) -> list[Result]:
        """``run_tokens`` of ``prompts`` (None where they were refused, with ``problems``)."""
        if self.has_unfinished():
            raise RuntimeError("requests submitted with Engine.submit are unfinished (or have "
                               "outputs not yet taken): step until has_unfinished() is False "
                               "before Engine.run (an abort() ends a request at the next step)")
        problems += model_problems(self.model, self.runtime)  # cast, moved or patched again
        problems += filter(None, [logprobs_problem(logprobs, vocab_size(self.model))])
        problems += flag_problems(progress=progress)
        if sampling is None:  # greedy, as submit takes it
            sampling = GREEDY
        elif not isinstance(sampling, SamplingParams):  # helper 87: an AttributeError later
            problems.append(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        news = checked(problems, new_tokens_per_request, max_new_tokens,
                       None if prompts is None else len(prompts))
        eos = checked(problems, id_tuple, eos_token_ids, "eos_token_ids")
        # Weights written since the prefix cache filled, on any rank (one rank may load and
        # broadcast them: a broadcast bumps no version counter): every rank empties it.
        if agree(self.runtime, "Engine.run", problems, lambda: fingerprint(
                prompts=prompts and [list(p) for p in prompts], max_new_tokens=news,
                sampling=sampling, eos_token_ids=eos, logprobs=as_int(logprobs)),
                flag=self._weights.changed()):
            self.reset_prefix_cache()
        return self.run_agreed(prompts, news, sampling, eos, progress, tokenizer, logprobs)

    def run_agreed(self, prompts: Sequence[Sequence[int]], news: list[int],
                   sampling: SamplingParams, eos_token_ids: Sequence[int], progress: bool,
                   tokenizer, logprobs: int | None) -> list[Result]:
        """``run_tokens`` once its arguments are checked and every rank agrees on them
        (``torch_cp.generate`` checks them itself, on a fresh engine)."""
        warn_ignored_sampling(sampling)
        self._ahead = self._inflight = None  # request indices restart with every run
        capacity = self.allocator.num_pages * self.page_size
        requests, results = make_requests(prompts, news, vocab_size(self.model), capacity)
        warn_past_positions(self.model, requests)
        scheduler = Scheduler(self.allocator, self.max_tokens_per_step, self.max_rows)
        for request in requests:
            scheduler.add(request)
        eos = frozenset(eos_token_ids)
        generators = {r.index: sampling.generator(r.index) for r in scheduler.waiting}
        if logprobs is not None:  # the rows whose log-probabilities the steps take
            self._options = {r.index: Options(sampling, frozenset(), None, as_int(logprobs))
                             for r in scheduler.waiting}
        token_logprobs = {r.index: [] for r in scheduler.waiting}
        try:
            with Progress(scheduler.waiting, show=progress) as bar:
                while not scheduler.done:
                    reused = scheduler.reused_tokens
                    prefilled, new, ended = self._step(scheduler, sampling, generators, eos)
                    self.prefilled_tokens += prefilled
                    self.reused_tokens += scheduler.reused_tokens - reused
                    bar.advance(prefilled + scheduler.reused_tokens - reused, new)
                    for rid, lp in self._token_logprobs().items():
                        token_logprobs[rid].append(lp)
                    for request, reason, error in ended:
                        results[request.index] = Result(
                            request.index, tuple(request.generated), reason, error=error,
                            logprobs=tuple(token_logprobs[request.index]))
                        bar.stop(request)
            self._settle_ahead()
        except BaseException:  # KeyboardInterrupt too: the pool must be whole for the next run
            scheduler.abort_all()
            raise
        finally:
            self._ahead = self._inflight = None
            self._options = {}
        assert self.allocator.free_pages == self.allocator.num_pages, "every page returns"
        ordered = [results[i] for i in range(len(prompts))]
        return ordered if tokenizer is None else with_text(ordered, tokenizer)
