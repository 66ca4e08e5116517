"""`TorchEngine`: batched, KV-cached sampling on a Hugging Face causal LM in this process."""

from __future__ import annotations

import inspect
from collections.abc import Collection, Sequence

import torch

from aurora.codec import Weights
from aurora.config.rl import EngineSpec
from aurora.errors import DeltaFormatError
from aurora.rl.engines.base import VerifiedApply, WeightUpdate, prompt_ids, sample_seed
from aurora.rl.model import Tokenizer, build_model
from aurora.rl.types import Completion, Prompt, Sample


class TorchEngine(VerifiedApply):
    """`Engine` on a Hugging Face causal LM: fp32 compute over bf16-valued weights, KV-cached sampling.

    The parameters hold bf16 values in fp32 (a lossless widening), so reading
    them back as bf16 gives exactly the published bits."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.tok = Tokenizer.for_model(spec.the_model)
        self.model = build_model(spec.the_model).float()
        self._params = dict(self.model.named_parameters())
        # transformers 5.24 renamed the KV cache argument from past_key_values to cache
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.version: int | None = None

    # -- weights
    def weights(self) -> Weights:
        with torch.no_grad():
            return Weights.from_tensors({n: p.detach().to(torch.bfloat16) for n, p in self._params.items()})

    def apply(self, update: WeightUpdate) -> None:
        names = set(update.weights)
        if names != set(self._params):
            missing, extra = sorted(set(self._params) - names), sorted(names - set(self._params))
            raise DeltaFormatError(f"weights do not fit the model: missing {missing[:3]}, unknown {extra[:3]}")
        super().apply(update)

    def _copy(self, host: Weights, names: Collection[str] | None) -> None:
        tensors = host.to_tensors()
        with torch.no_grad():
            for n in tensors if names is None else names:
                self._params[n].copy_(tensors[n])

    # -- sampling
    def generate(self, prompts: Sequence[Prompt], version: int, n: int = 1) -> list[Completion]:
        self._serving(version)
        if not prompts:
            return []
        gen = torch.Generator().manual_seed(sample_seed(self.spec.seed, version, [p.id for p in prompts]))
        encoded = [prompt_ids(p, self.tok) for p in prompts]
        toks, lps = self._sample([ids for ids in encoded for _ in range(n)], gen)
        samples = [Sample(t, lp) for t, lp in zip(toks, lps, strict=True)]
        return [
            Completion(p.id, ids, samples[i * n : i * n + n], version)
            for i, (p, ids) in enumerate(zip(prompts, encoded, strict=True))
        ]

    @torch.no_grad()
    def _sample(self, prompts: list[list[int]], gen: torch.Generator) -> tuple[list[list[int]], list[list[float]]]:
        pad, eos = self.tok.pad_id, self.tok.eos_id
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        b = len(prompts)
        done = torch.zeros(b, dtype=torch.bool)
        toks: list[list[int]] = [[] for _ in range(b)]
        lps: list[list[float]] = [[] for _ in range(b)]
        for _ in range(self.spec.max_new_tokens):
            logits = out.logits[:, -1, :].float()
            t = self.spec.temperature
            logp = torch.log_softmax(logits / t if t > 0 else logits, dim=-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0] if t > 0 else logits.argmax(-1)
            chosen = logp.gather(1, nxt[:, None])[:, 0]
            for i in range(b):
                if not done[i]:
                    toks[i].append(int(nxt[i]))
                    lps[i].append(float(chosen[i]))
            if not self.spec.fixed_length:
                done |= nxt == eos
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype)], dim=1)
            pos = pos[:, -1:] + 1
            cache = {self._cache_arg: getattr(out, self._cache_arg)}
            out = self.model(
                input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1, **cache
            )
        return toks, lps
