"""Text rendering: how closely the text an OCR reader sees matches the quoted text of the prompt.

Shape legend: B batch.

The task is Flow-GRPO's OCR task (Liu et al. 2025, "Flow-GRPO", visual text rendering): prompts
carry the text to draw in double quotes, e.g. `A shop sign that says "OPEN 24 HOURS"`. Flow-GRPO
scores an image with PaddleOCR as 1 - (edit distance / target length), the distance capped at the
target length, after removing whitespace and lower-casing both texts. We keep that score and
write our own code around a pluggable reader:

    target = the prompt's quoted spans (straight "..." or curly “...”), joined by a space
    t, r   = target and read text with all whitespace removed, lower-cased
    score  = max(0, 1 - levenshtein(r, t) / len(t))          in [0, 1], 1 = exact

The normalisation is the *target* length (not max(len(r), len(t))): missing characters cost
1/len(t) each, and a reader that sees much more text than asked for scores 0, not below. A prompt
without quoted text has no target: its sample scores NaN (the combined reward drops it).

The reader is any transformers image-to-text model in a local folder with its processor:
`VisionEncoderDecoderModel` checkpoints such as TrOCR (`microsoft/trocr-base-printed`; a
single-line reader, so it suits images that are mostly the text), or whole-image OCR models that
`AutoModelForImageTextToText` loads and whose processor builds its own prompt from the image alone,
such as GOT-OCR 2.0 (`stepfun-ai/GOT-OCR-2.0-hf`). Reading is greedy decoding, in batches.
"""

from __future__ import annotations

import re

import torch

from spotlight.rewards.local_models import batch_slices, pick_device, require_local_dir, to_uint8_images
from spotlight.rewards.registry import register_reward

_QUOTED = re.compile(r'"([^"]*)"|\u201c([^\u201d]*)\u201d')
_SPACE = re.compile(r"\s+")

DOWNLOAD_HINT = (
    "an OCR model with its processor, e.g. the Hugging Face repo microsoft/trocr-base-printed "
    "(TrOCR, single text lines) or stepfun-ai/GOT-OCR-2.0-hf (whole images)"
)


def quoted_text(prompt: str) -> str | None:
    """The text a prompt asks to render: its quoted spans joined by a space; None when it has none.

    Args:
        prompt: e.g. `A sign that says "OPEN 24 HOURS"`.
    """
    spans = [a or b for a, b in _QUOTED.findall(prompt)]
    spans = [s for s in spans if s.strip()]
    return " ".join(spans) if spans else None


def normalize_text(text: str) -> str:
    """Whitespace removed, lower-cased: OCR readers disagree on spacing and case, prompts too."""
    return _SPACE.sub("", text).lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance: the fewest single-character insertions, deletions and substitutions."""
    if len(a) < len(b):
        a, b = b, a
    # Wagner-Fischer with one row: prev[j] is the distance between a[:i] and b[:j].
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        cur = [i]
        for j, cb in enumerate(b, start=1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def ocr_score(read: str, target: str) -> float:
    """max(0, 1 - levenshtein(read, target) / len(target)) after `normalize_text` of both.

    Args:
        read: what the OCR reader saw.
        target: the prompt's quoted text.

    Raises:
        ValueError: if the target has no characters but whitespace.
    """
    t, r = normalize_text(target), normalize_text(read)
    if not t:
        raise ValueError(f"OCR target {target!r} has no characters to read")
    return max(0.0, 1.0 - levenshtein(r, t) / len(t))


class OcrReader:
    """A transformers image-to-text model and its processor, loaded from a local folder.

    Args:
        path: the folder (model, config, processor), as `save_pretrained` writes it.
        device: where the model runs.
        max_new_tokens: most tokens read per image.
        batch_size: images per generate call.
    """

    def __init__(self, path, device: torch.device, *, max_new_tokens: int, batch_size: int):
        # Imported here: transformers takes seconds to import, and most runs use no OCR reward.
        from transformers import AutoModelForImageTextToText, AutoProcessor

        # AutoModelForImageTextToText maps both kinds: vision-encoder-decoder (TrOCR) and
        # decoder-only VLMs such as GOT-OCR 2.0.
        self.model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True).to(device).eval()
        self.processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        self.tokenizer = self.processor.tokenizer
        self.tokenizer.padding_side = "left"  # decoder-only generation continues after the prompt
        self.special_ids = set(self.tokenizer.all_special_ids)
        self.device = device
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size

    @torch.inference_mode()
    def read(self, images: list) -> list[str]:
        """The text in each image.

        Args:
            images: (H, W, 3) uint8 RGB arrays.
        """
        texts: list[str] = []
        for batch in batch_slices(len(images), self.batch_size):
            inputs = self.processor(images=images[batch], return_tensors="pt").to(self.device)
            ids = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False, num_beams=1)
            if not self.model.config.is_encoder_decoder:
                ids = ids[:, inputs["input_ids"].shape[1] :]  # a decoder-only model echoes its prompt
            texts += [self.tokenizer.decode(self._answer(row)) for row in ids.tolist()]
        return texts

    def _answer(self, ids: list[int]) -> list[int]:
        """The tokens of the reading: after any leading special tokens (a decoder start token),
        up to the next special one (end of text or of turn, padding). A reader whose generation
        config does not stop at its end-of-turn token (GOT-OCR 2.0 is run with a stop string) may
        write on after it; that text is no part of the reading."""
        start = 0
        while start < len(ids) and ids[start] in self.special_ids:
            start += 1
        end = next((j for j in range(start, len(ids)) if ids[j] in self.special_ids), len(ids))
        return ids[start:end]


@register_reward("ocr")
def make_ocr_reward(ocr_model_path: str = "", ocr_max_new_tokens: int = 64, batch_size: int = 16, ocr_device: str = ""):
    """Edit-distance score of the prompt's quoted text against what an OCR reader sees.

    Args:
        ocr_model_path: local folder of the reader and its processor.
        ocr_max_new_tokens: most tokens the reader generates per image.
        batch_size: images per reader call.
        ocr_device: where the reader runs; empty means cuda when available, else cpu.
    """
    path = require_local_dir("ocr", "reward.ocr_model_path", ocr_model_path, DOWNLOAD_HINT)
    if ocr_max_new_tokens < 1:
        raise ValueError(f"reward.ocr_max_new_tokens is {ocr_max_new_tokens}; use 1 or more")
    reader = OcrReader(path, pick_device(ocr_device), max_new_tokens=ocr_max_new_tokens, batch_size=batch_size)

    def ocr(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        targets = [quoted_text(p) for p in prompts]
        scores_B = torch.full((len(prompts),), float("nan"), dtype=torch.float32)
        rows = [i for i, t in enumerate(targets) if t is not None]
        if rows:
            arrays = to_uint8_images(images)
            read = reader.read([arrays[i] for i in rows])
            for i, text in zip(rows, read, strict=True):
                scores_B[i] = ocr_score(text, targets[i])
        return scores_B

    return ocr
