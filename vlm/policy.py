"""The VLM policy: a Qwen2.5-VL / Qwen3-VL model and its processor, loaded from one folder.

Shape legend: B sequences, L prompt tokens (left-padded), T response tokens (right-padded),
N vision patches of a batch (all images concatenated), C patch channels, V vocabulary.

A model folder is what `save_pretrained` writes for the model and the processor (config.json,
weights, tokenizer, image processor config, chat template): a real checkpoint and the tiny CPU
model (`vlm.tiny`) load through the same `from_pretrained` calls and run the same forward.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from vlm.processor import load_processor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# LoRA targets (as regexes on module names): the language model's attention and MLP projections,
# and optionally the vision tower's (Qwen2.5-VL's MLP is gated, Qwen3-VL's is fc1/fc2).
LM_LORA = r"model\.language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
VISION_LORA = r"model\.visual\.blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(gate_proj|up_proj|down_proj|linear_fc1|linear_fc2))"


@dataclass
class PromptBatch:
    """Processor outputs for B prompts, one image each, left-padded (the layout generate wants)."""

    input_ids_BL: torch.Tensor
    """(B, L) token ids, image placeholders expanded."""
    attention_mask_BL: torch.Tensor
    """(B, L) 1 for real tokens, 0 for left padding."""
    mm_token_type_ids_BL: torch.Tensor
    """(B, L) 0 text, 1 image token (the multimodal rope reads it)."""
    pixel_values_NC: torch.Tensor | None
    """(N, C) flattened vision patches of all images, in row order (None when only image_outputs is carried)."""
    image_grid_thw_B3: torch.Tensor
    """(B, 3) patch grid (t, h, w) of each row's image."""
    image_outputs: Any = None
    """The vision encoder's output for these rows (what `get_image_features` returns, one image per
    row), computed once elsewhere; when set the model reads it instead of running the tower on
    pixel_values (the Rollplex schedule shares one prompt's features among its G rows)."""

    @property
    def num_rows(self) -> int:
        return self.input_ids_BL.shape[0]

    def model_inputs(self) -> dict[str, Any]:
        inputs = {
            "input_ids": self.input_ids_BL,
            "attention_mask": self.attention_mask_BL,
            "mm_token_type_ids": self.mm_token_type_ids_BL,
            "image_grid_thw": self.image_grid_thw_B3,
        }
        if self.image_outputs is None:
            inputs["pixel_values"] = self.pixel_values_NC
        else:
            inputs["mm_encoder_outputs"] = {"image": self.image_outputs}
        return inputs

    def select(self, rows: list[int]) -> PromptBatch:
        """The batch of the given rows (in that order); rows may repeat."""
        index = torch.tensor(rows, dtype=torch.long)
        pixel_values_NC = None
        if self.pixel_values_NC is not None:
            counts = self.image_grid_thw_B3.prod(dim=-1)
            starts = torch.cumsum(counts, 0) - counts
            patch_index = torch.cat([torch.arange(int(starts[r]), int(starts[r] + counts[r])) for r in rows])
            pixel_values_NC = self.pixel_values_NC.index_select(0, patch_index.to(self.pixel_values_NC.device))
        return PromptBatch(
            input_ids_BL=self.input_ids_BL[index],
            attention_mask_BL=self.attention_mask_BL[index],
            mm_token_type_ids_BL=self.mm_token_type_ids_BL[index],
            pixel_values_NC=pixel_values_NC,
            image_grid_thw_B3=self.image_grid_thw_B3[index],
            image_outputs=None if self.image_outputs is None else select_image_outputs(self.image_outputs, rows),
        )

    def repeat_rows(self, num_repeats: int) -> PromptBatch:
        """Each row `num_repeats` times in a row (prompt-major: the G samples of a group are adjacent)."""
        return self.select([r for r in range(self.num_rows) for _ in range(num_repeats)])

    def to(self, device: torch.device | str) -> PromptBatch:
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if getattr(self, f.name) is not None and f.name != "image_outputs"
        }
        if self.image_outputs is not None:
            moved["image_outputs"] = select_image_outputs(
                self.image_outputs, range(len(self.image_outputs.pooler_output)), device
            )
        return replace(self, **moved)


def select_image_outputs(outputs, rows, device: torch.device | str | None = None):
    """The vision encoder outputs of the given images (rows may repeat), optionally moved to `device`.

    `outputs` is what `get_image_features` returns: `pooler_output` is a tuple of (tokens, D)
    tensors, one per image, and Qwen3-VL adds `deepstack_features`, one such tuple per layer.
    """

    def pick(per_image):
        return tuple(per_image[r] if device is None else per_image[r].to(device) for r in rows)

    picked = {"pooler_output": pick(outputs.pooler_output)}
    if getattr(outputs, "deepstack_features", None) is not None:
        picked["deepstack_features"] = [pick(f) for f in outputs.deepstack_features]
    return type(outputs)(**picked)


class VLMPolicy:
    """A VLM and its processor, with the calls the rollout, the trainer and the evaluation need."""

    def __init__(self, model, processor, *, device: str | torch.device = "cpu"):
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.device = torch.device(device)
        self.eos_token_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.pad_token_id = self.tokenizer.pad_token_id
        # Vision placeholders in a response would be read as image slots by the next forward;
        # the policy is defined with them (and padding) masked out, in sampling and in training.
        banned = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
        self.banned_token_ids = sorted({self.tokenizer.convert_tokens_to_ids(t) for t in banned} | {self.pad_token_id})

    @classmethod
    def load(
        cls, path: str | Path, *, dtype: str = "float32", device: str = "cpu", field: str = "model.path"
    ) -> VLMPolicy:
        """Load a model folder (`field` names the config entry in error messages)."""
        from transformers import AutoModelForImageTextToText

        folder = Path(path).expanduser()
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"{field}: {str(folder)!r} is not a model folder (no config.json); give the folder that "
                "save_pretrained "
                "wrote, or build the tiny one with `spotlight vlm warmstart configs/vlm/tiny-warmstart.yaml`"
            )
        model_type = json.loads((folder / "config.json").read_text())["model_type"]
        processor = load_processor(folder, model_type, field=field)
        model = AutoModelForImageTextToText.from_pretrained(folder, dtype=DTYPES[dtype]).to(device)
        return cls(model, processor, device=device)

    def encode(self, questions: list[str], images: list) -> PromptBatch:
        """Apply the chat template to (image, question) pairs and run the processor.

        Args:
            questions: B questions.
            images: B PIL images.
        """
        messages = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}] for q in questions]
        texts = [self.processor.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
        self.tokenizer.padding_side = "left"
        out = self.processor(text=texts, images=images, return_tensors="pt", padding=True)
        return PromptBatch(
            input_ids_BL=out["input_ids"],
            attention_mask_BL=out["attention_mask"],
            mm_token_type_ids_BL=out["mm_token_type_ids"],
            pixel_values_NC=out["pixel_values"],
            image_grid_thw_B3=out["image_grid_thw"],
        )

    def decode(self, response_ids_BT: torch.Tensor, response_mask_BT: torch.Tensor) -> list[str]:
        """Response texts without special tokens."""
        return [
            self.tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True).strip()
            for ids, mask in zip(response_ids_BT.cpu(), response_mask_BT.cpu())
        ]

    def add_lora(self, rank: int, alpha: float, *, vision: bool) -> None:
        """Wrap the model with a peft LoRA adapter (trainable); every base weight is frozen."""
        from peft import LoraConfig, get_peft_model

        target = f"({LM_LORA}|{VISION_LORA})" if vision else LM_LORA
        self.model = get_peft_model(
            self.model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=target, lora_dropout=0.0)
        )

    @property
    def has_lora(self) -> bool:
        return bool(getattr(self.model, "peft_config", None))

    def freeze_vision(self) -> None:
        """Freeze the vision tower and its merger (the language model and LM head still train)."""
        for p in self.base_model.model.visual.parameters():
            p.requires_grad_(False)

    @property
    def base_model(self):
        """The transformers model (under the peft wrapper when LoRA is on)."""
        return self.model.get_base_model() if self.has_lora else self.model


def mask_banned(logits: torch.Tensor, banned_token_ids: list[int]) -> torch.Tensor:
    """(..., V) logits with the banned tokens at -inf."""
    index = torch.tensor(banned_token_ids, dtype=torch.long, device=logits.device)
    return logits.index_fill(-1, index, float("-inf"))


def response_logprobs(
    policy: VLMPolicy,
    prompts: PromptBatch,
    response_ids_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    temperature: float,
    *,
    model=None,
) -> torch.Tensor:
    """Log-probabilities of the response tokens under `model`, at the sampling temperature.

    One forward over [prompt, response]; the multimodal rope positions follow the attention mask,
    so left padding and the padding after a response's end token change nothing.

    Args:
        policy: the policy (its banned tokens, device and, unless `model` is given, its model).
        prompts: the B prompts, one per response.
        response_ids_BT: (B, T) sampled tokens.
        response_mask_BT: (B, T) 1 for tokens of the response (its end token included).
        temperature: logits are divided by it, as when sampling.
        model: another model to score with (e.g. the frozen reference); default policy.model.

    Returns:
        (B, T) log pi(token | prefix); 0 where the mask is 0.
    """
    model = policy.model if model is None else model
    prompts = prompts.to(policy.device)
    response_ids_BT = response_ids_BT.to(policy.device)
    response_mask_BT = response_mask_BT.to(policy.device)
    num_resp = response_ids_BT.shape[1]
    inputs = prompts.model_inputs()
    inputs["input_ids"] = torch.cat([prompts.input_ids_BL, response_ids_BT], dim=1)
    inputs["attention_mask"] = torch.cat(
        [prompts.attention_mask_BL, response_mask_BT.to(prompts.attention_mask_BL.dtype)], dim=1
    )
    inputs["mm_token_type_ids"] = torch.cat([prompts.mm_token_type_ids_BL, torch.zeros_like(response_ids_BT)], dim=1)
    # Logits at positions L-1 .. L+T-2 predict the T response tokens; the last one predicts nothing.
    logits_BTV = model(**inputs, logits_to_keep=num_resp + 1, use_cache=False).logits[:, :-1]
    return token_logprobs(logits_BTV, response_ids_BT, response_mask_BT, policy.banned_token_ids, temperature)


def token_logprobs(
    logits_BTV: torch.Tensor,
    response_ids_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    banned_token_ids: list[int],
    temperature: float,
) -> torch.Tensor:
    """(B, T) log-probs of the response tokens from the logits that predict them (0 where the mask is 0)."""
    logp_BTV = torch.log_softmax(mask_banned(logits_BTV.float(), banned_token_ids) / temperature, dim=-1)
    logp_BT = logp_BTV.gather(-1, response_ids_BT.unsqueeze(-1)).squeeze(-1)
    # Padding after the end token is a banned token (log-prob -inf): zero it, do not multiply.
    return torch.where(response_mask_BT.bool(), logp_BT, torch.zeros_like(logp_BT))


def load_policy(model_cfg, *, trainable: bool = True, seed: int | None = None) -> VLMPolicy:
    """The recipe's policy: LoRA or full fine-tuning, vision tower trained or frozen.

    `seed` (the run's `train.seed`) seeds a LoRA adapter's initial weights (`spotlight.core.seeds.seeded_init`).
    """
    from spotlight.core.seeds import seeded_init

    policy = VLMPolicy.load(model_cfg.path, dtype=model_cfg.dtype, device=model_cfg.device)
    if model_cfg.lora_rank:
        with seeded_init(seed, model_cfg.device):
            policy.add_lora(
                model_cfg.lora_rank, model_cfg.lora_alpha or model_cfg.lora_rank, vision=model_cfg.train_vision
            )
    elif not model_cfg.train_vision:
        policy.freeze_vision()
    if not trainable:
        policy.model.requires_grad_(False)
    policy.model.eval()  # no dropout: the rollout, the reference and the update see the same function
    return policy


def trainable_state(policy: VLMPolicy) -> dict[str, torch.Tensor]:
    """The weights training changes: the LoRA adapter, or every parameter that requires grad. Live
    tensors, as the DiT's `spotlight.policy.trainable_state`: clone them to keep a snapshot."""
    if policy.has_lora:
        from peft.utils import get_peft_model_state_dict

        return {k: v.detach() for k, v in get_peft_model_state_dict(policy.model).items()}
    return {n: p.detach() for n, p in policy.model.named_parameters() if p.requires_grad}


def load_trainable_state(policy: VLMPolicy, state: dict[str, torch.Tensor]) -> None:
    """Inverse of `trainable_state` (strict: every key must exist in the model)."""
    if policy.has_lora:
        from peft.utils import set_peft_model_state_dict

        result = set_peft_model_state_dict(policy.model, state)
        if result.unexpected_keys:
            raise ValueError(
                f"LoRA state has keys this model lacks (different lora_rank or model?): {result.unexpected_keys[:3]}"
            )
        return
    params = dict(policy.model.named_parameters())
    unknown = [k for k in state if k not in params]
    if unknown:
        raise ValueError(f"checkpoint has weights this model lacks (different model or LoRA setting?): {unknown[:3]}")
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)
