"""The Hugging Face systems a user would otherwise run, each timed the same way.

Every system returns a ``Timing``: wall time of the whole call, time to first token (until every
row of the batch has its first token), time per decode step (once every row decodes), tokens and
the peak of allocated device memory. Time stamps are taken after a device sync at each step.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from benchmarks.common import sync


@dataclass
class Timing:
    wall_s: float
    ttft_s: float | None
    step_ms: float | None
    new_tokens: int
    peak_gib: float | None
    note: str | None = None
    first_tokens: list[int] | None = None  # row 0's first generated tokens: same work everywhere

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s

    def as_dict(self) -> dict:
        return dict(asdict(self), tokens_per_s=self.tokens_per_s)


def peak_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class StepClock(LogitsProcessor):
    """Records a time stamp per generated token (called once per step, after its forward)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        sync(self.device)
        self.stamps.append(time.perf_counter())
        return scores


def decode_step_ms(stamps: list[float]) -> float | None:
    """Mean milliseconds between consecutive per-step stamps after the first (the prefill)."""
    if len(stamps) < 2:
        return None
    return (stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1)


def generation_config(new_tokens: int, **extra) -> GenerationConfig:
    """Greedy, exactly ``new_tokens`` tokens: no EOS, so nothing stops early."""
    return GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            do_sample=False, eos_token_id=None, pad_token_id=0, **extra)


def hf_generate(model, input_ids: torch.Tensor, new_tokens: int, cache: str,
                device: torch.device, compile_: bool = True) -> Timing:
    """``model.generate`` with the ``"static"`` cache (its decode forward compiled by
    transformers' default CompileConfig) or the ``"dynamic"`` cache (eager)."""
    extra = {}
    if cache == "static":
        extra["cache_implementation"] = "static"
        extra["disable_compile"] = not compile_
    cfg = generation_config(new_tokens, **extra)
    clock = StepClock(device)
    mask = torch.ones_like(input_ids)
    reset_peak(device)
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=cfg,
                             logits_processor=LogitsProcessorList([clock]))
    sync(device)
    wall = time.perf_counter() - start
    new = (out.shape[1] - input_ids.shape[1]) * out.shape[0]
    return Timing(wall, clock.stamps[0] - start if clock.stamps else None,
                  decode_step_ms(clock.stamps), new, peak_gib(device),
                  first_tokens=out[0, input_ids.shape[1]:][:8].tolist())


class CompiledLoop:
    """A hand-written static-cache decode loop: eager prefill, then one compiled step per token
    (``torch.compile(mode="reduce-overhead", fullgraph=True)``: CUDA graphs), greedy argmax."""

    def __init__(self, model, device: torch.device, backend: str = "inductor",
                 fullgraph: bool = True):
        self.model = model
        self.device = device
        self.fullgraph = fullgraph
        options = dict(mode="reduce-overhead") if backend == "inductor" else {}
        self.step = torch.compile(self._step, fullgraph=fullgraph, backend=backend, **options)

    def _step(self, token: torch.Tensor, position: torch.Tensor, cache) -> torch.Tensor:
        logits = self.model(input_ids=token, position_ids=position, past_key_values=cache,
                            use_cache=True).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    def run(self, input_ids: torch.Tensor, new_tokens: int, cache) -> Timing:
        """``cache``: a StaticCache of at least prompt + new_tokens positions (reset here)."""
        batch, prompt = input_ids.shape
        reset_peak(self.device)
        sync(self.device)
        start = time.perf_counter()
        stamps = []
        # no_grad, not inference_mode: the cache's tensors are updated in place by the compiled
        # step, which inference tensors forbid outside inference mode.
        with torch.no_grad():
            cache.reset()
            positions = torch.arange(prompt, device=self.device).expand(batch, prompt)
            logits = self.model(input_ids=input_ids, position_ids=positions,
                                past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
            sync(self.device)
            stamps.append(time.perf_counter())
            position = torch.full((batch, 1), prompt, dtype=torch.long, device=self.device)
            out = [token]
            for _ in range(new_tokens - 1):
                token = self.step(token, position, cache).clone()
                position = position + 1
                out.append(token)
            sync(self.device)
            stamps.append(time.perf_counter())
        wall = stamps[-1] - start
        step = (stamps[-1] - stamps[0]) * 1e3 / max(new_tokens - 1, 1)
        return Timing(wall, stamps[0] - start, step, batch * len(out), peak_gib(self.device),
                      None if self.fullgraph else "fullgraph=False",
                      [int(t[0, 0]) for t in out[:8]])


def static_cache(model, max_len: int):
    """A StaticCache of ``max_len`` positions (its tensors are allocated by the first update)."""
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_len)


def hf_generate_batch(model, prompts: list[list[int]], new_tokens: int, device: torch.device,
                      smoke: bool = False) -> tuple[Timing, float]:
    """transformers' continuous batching (``model.generate_batch``): a warm-up call (CUDA graph
    capture), then the timed call on the same persistent manager. Returns (timing, warm-up s)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cfg = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    cb = ContinuousBatchingConfig(max_memory_percent=0.5, allow_block_sharing=False,
                                  use_cuda_graph=False if smoke else None)
    kwargs = dict(generation_config=cfg, continuous_batching_config=cb, progress_bar=False,
                  persistent_manager=True)
    t0 = time.perf_counter()  # warm-up: same batch, a few tokens (captures its graphs)
    model.generate_batch(inputs=[list(p) for p in prompts], max_new_tokens=8, **kwargs)
    warm = time.perf_counter() - t0
    try:
        reset_peak(device)
        sync(device)
        start = time.perf_counter()
        outs = model.generate_batch(inputs=[list(p) for p in prompts], record_timestamps=True,
                                    **kwargs)
        sync(device)
        wall = time.perf_counter() - start
    finally:
        model.destroy_cached_continuous_batching_manager()
    outs = list(outs.values())
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"generate_batch: {errors[0]}")
    new = sum(len(o.generated_tokens) for o in outs)
    firsts = [o.timestamps[0] for o in outs if o.timestamps]
    steps = [(o.timestamps[-1] - o.timestamps[0]) * 1e3 / (len(o.timestamps) - 1)
             for o in outs if o.timestamps and len(o.timestamps) > 1]
    ttft = max(firsts) - start if firsts else None
    step = sorted(steps)[len(steps) // 2] if steps else None
    first = sorted(outs, key=lambda o: int(o.request_id.rsplit("_", 1)[-1]))[0]
    return Timing(wall, ttft, step, new, peak_gib(device),
                  first_tokens=list(first.generated_tokens[:8])), warm
