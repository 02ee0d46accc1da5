"""Rollout engines: sample G responses per prompt, seeded, returning token ids and masks.

Shape legend: P prompts, G samples per prompt, B = P * G sequences (prompt-major), T response
tokens, V vocabulary.

Seeding: sample g of prompt p draws from its own generator, seeded with derive_seed(seed, p, g),
so a response does not depend on which other prompts share its batch, on the batch size, or on
which data-parallel rank samples it (`rows`). The transformers engine samples with the Gumbel-max
trick (Gumbel 1954; Maddison et al. 2014): argmax(logits / temperature + Gumbel noise) is an exact
sample of softmax(logits / temperature), so a greedy `generate` with a logits processor that adds
per-row noise samples the policy while the noise stays ours. Temperature 0 is plain greedy decoding (evaluation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from spotlight.core.seeds import derive_seed
from vlm.policy import PromptBatch, VLMPolicy, mask_banned


@dataclass
class Rollout:
    """G sampled responses for each of P prompts."""

    prompts: PromptBatch
    """The B = P * G prompt rows (each prompt repeated G times, prompt-major), or a rank's slice of them."""
    response_ids_BT: torch.Tensor
    """(B, T) sampled tokens; padding after the end token."""
    response_mask_BT: torch.Tensor
    """(B, T) 1 for the response's tokens up to and including its end token (all T if it has none)."""
    texts: list[str]
    """B decoded responses."""

    def select(self, rows: list[int]) -> Rollout:
        """The rollout of the given rows only."""
        return Rollout(
            self.prompts.select(rows),
            self.response_ids_BT[rows],
            self.response_mask_BT[rows],
            [self.texts[r] for r in rows],
        )


class RolloutEngine(Protocol):
    """Samples responses with the current weights (a transformers or, later, a vLLM backend)."""

    def generate(
        self,
        batch: PromptBatch,
        num_samples: int,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        *,
        rows: range | None = None,
        pad: int = 0,
    ) -> Rollout:
        """Sample `num_samples` responses for each prompt of `batch`.

        Args:
            batch: P prompts; with `rows`, the prompts those rows belong to (see `prompts_of`).
            num_samples: G.
            max_new_tokens: most tokens per response.
            temperature: > 0 samples softmax(logits / temperature); 0 decodes greedily.
            seed: the rollout's seed; sample g of prompt p uses derive_seed(seed, p, g).
            rows: which rows of the whole prompt-major P * G rollout to sample (default: all). A
                data-parallel rank samples its contiguous slice; row r keeps the seed
                derive_seed(seed, r // G, r % G) whatever the slice, so no response depends on the rank.
            pad: sample this many repeats of the last row too, and drop them (an FSDP rank samples as
                many rows as the others: every forward is a collective).
        """
        ...


def prompts_of(rows: range, group_size: int) -> range:
    """The prompts (indices in the whole batch) that the prompt-major rollout rows `rows` belong to."""
    return range(rows.start // group_size, -(-rows.stop // group_size)) if len(rows) else range(0)


class BanTokens:
    """A transformers logits processor: the policy's banned tokens get -inf (see `VLMPolicy`)."""

    def __init__(self, banned_token_ids: list[int]):
        self.banned_token_ids = banned_token_ids

    def __call__(self, input_ids: torch.LongTensor, scores_BV: torch.Tensor) -> torch.Tensor:
        return mask_banned(scores_BV, self.banned_token_ids)


class GumbelNoise:
    """A transformers logits processor: adds per-row seeded Gumbel noise to logits / temperature.

    Each row has its own generator, seeded by its row seed, so a row's noise does not depend on
    the batch it decodes in. The generators live on the device of the logits (made at the first
    call): on a GPU the noise is drawn there, instead of B vocabulary-sized draws on the CPU and
    a host-to-device copy of them at every decode step. A row's stream is the device's own (the
    CPU's and CUDA's generators give different numbers for one seed).
    """

    def __init__(self, row_seeds: list[int], temperature: float):
        self.temperature = temperature
        self.row_seeds = list(row_seeds)
        self.generators: list[torch.Generator] = []

    def _generators_on(self, device: torch.device) -> list[torch.Generator]:
        if not self.generators:
            for s in self.row_seeds:
                g = torch.Generator(device=device)
                g.manual_seed(s)
                self.generators.append(g)
        return self.generators

    def __call__(self, input_ids: torch.LongTensor, scores_BV: torch.Tensor) -> torch.Tensor:
        assert scores_BV.shape[0] == len(self.row_seeds), (scores_BV.shape, len(self.row_seeds))
        vocab, device = scores_BV.shape[1], scores_BV.device
        # u in (0, 1): -log(-log(u)) is standard Gumbel noise.
        u_BV = torch.stack(
            [torch.rand(vocab, generator=g, dtype=torch.float64, device=device) for g in self._generators_on(device)]
        )
        gumbel_BV = -torch.log(-torch.log(u_BV.clamp(1e-20, 1.0 - 1e-12)))
        return scores_BV.float() / self.temperature + gumbel_BV.float()


def response_mask(response_ids_BT: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(B, T) 1 up to and including the first end token of each row, 0 after it."""
    is_eos = (response_ids_BT == eos_token_id).long()
    ended_before = torch.cumsum(is_eos, dim=1) - is_eos  # end tokens strictly before t
    return (ended_before == 0).long()


def generation_positions(policy: VLMPolicy, prompts: PromptBatch) -> torch.Tensor:
    """(4, P, L) the position ids transformers' `generate` derives for Qwen-VL prompts: the text
    positions (attention-mask cumsum), then the three multimodal rope axes (`get_rope_index`).

    `generate` would compute them for every row, i.e. G times per prompt, in a Python loop over rows
    that took a third of the tiny recipe's rollout time; computed here once per prompt and indexed
    per row, with the same values.
    """
    mask_PL = prompts.attention_mask_BL
    text_PL = (mask_PL.long().cumsum(-1) - 1).masked_fill(mask_PL == 0, 0)
    rope_3PL, _ = policy.base_model.model.get_rope_index(
        prompts.input_ids_BL,
        mm_token_type_ids=prompts.mm_token_type_ids_BL,
        image_grid_thw=prompts.image_grid_thw_B3,
        attention_mask=mask_PL,
    )
    return torch.cat([text_PL[None].to(rope_3PL.device), rope_3PL], dim=0)


class HFRolloutEngine:
    """Rollouts with transformers' `generate` (KV cache, one call per `batch_size` sequences).

    Args:
        policy: the policy whose current weights sample.
        batch_size: sequences per generate call (results do not depend on it).
        synced_gpus: the model is FSDP-sharded: every forward is a collective, so each rank keeps
            running forwards (transformers' `synced_gpus`) until every rank's sequences have
            ended; the caller gives every rank as many rows (`generate`'s `pad`).
    """

    def __init__(self, policy: VLMPolicy, *, batch_size: int = 128, synced_gpus: bool = False):
        self.policy = policy
        self.batch_size = batch_size
        self.synced_gpus = synced_gpus

    @torch.no_grad()
    def generate(
        self,
        batch: PromptBatch,
        num_samples: int,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        *,
        rows: range | None = None,
        pad: int = 0,
    ) -> Rollout:
        from transformers import GenerationConfig, LogitsProcessorList

        policy = self.policy
        G = num_samples
        rows = range(batch.num_rows * G) if rows is None else rows
        assert len(prompts_of(rows, G)) == batch.num_rows, (rows, batch.num_rows)
        row_seeds = [derive_seed(seed, r // G, r % G) for r in rows]
        prompt_of_row = [r // G - rows.start // G for r in rows]
        prompt_rows = batch.select(prompt_of_row)  # each prompt once per sample
        num_rows = prompt_rows.num_rows
        if pad:  # repeats of the last row, sampled then dropped: as many generate calls as the other ranks
            row_seeds += row_seeds[-1:] * pad
            prompt_of_row += prompt_of_row[-1:] * pad
            prompt_rows = prompt_rows.select(list(range(num_rows)) + [num_rows - 1] * pad)
        positions_4BL = generation_positions(policy, batch)[:, prompt_of_row]
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=policy.eos_token_id,
            pad_token_id=policy.pad_token_id,
        )
        chunks = []
        for start in range(0, prompt_rows.num_rows, self.batch_size):
            idx = list(range(start, min(start + self.batch_size, prompt_rows.num_rows)))
            part = prompt_rows.select(idx).to(policy.device)
            processors = LogitsProcessorList([BanTokens(policy.banned_token_ids)])
            if temperature > 0:
                processors.append(GumbelNoise(row_seeds[idx[0] : idx[-1] + 1], temperature))
            out = policy.model.generate(
                **part.model_inputs(),
                position_ids=positions_4BL[:, idx].to(policy.device),
                generation_config=config,
                logits_processor=processors,
                synced_gpus=self.synced_gpus,
            )
            chunks.append(out[:, part.input_ids_BL.shape[1] :].cpu())
        width = max(c.shape[1] for c in chunks)
        response_ids_BT = torch.cat(
            [torch.nn.functional.pad(c, (0, width - c.shape[1]), value=policy.pad_token_id) for c in chunks]
        )
        if pad:  # drop the padding rows (a repeat of the last row: it adds no width)
            response_ids_BT, prompt_rows = response_ids_BT[:num_rows], prompt_rows.select(list(range(num_rows)))
        mask_BT = response_mask(response_ids_BT, policy.eos_token_id)
        response_ids_BT = torch.where(
            mask_BT.bool(), response_ids_BT, torch.full_like(response_ids_BT, policy.pad_token_id)
        )
        return Rollout(prompt_rows, response_ids_BT, mask_BT, policy.decode(response_ids_BT, mask_BT))


ENGINES = {"hf": HFRolloutEngine}
"""Rollout engine classes by `rollout.engine` name."""
