"""Tiny random reward models built from config: the tests' stand-ins for the real checkpoints.

Each builder writes what `save_pretrained` writes for the real model, with the same classes, so
the rewards load them through their real `from_pretrained` path: a `CLIPModel` (CLIPScore,
PickScore), two OCR readers (a TrOCR-style `VisionEncoderDecoderModel` with a `TrOCRProcessor`, and
a decoder-only `GotOcr2ForConditionalGeneration` with a `GotOcr2Processor`), and a `DetrForObjectDetection` with a small
ResNet backbone (no timm, nothing
pretrained) and its image processor. Nothing can be downloaded here, so the tokenizers are trained
locally with `tokenizers` and saved next to the model. The weights are random: the scores mean
nothing, the code path is the real one.

The image processors are the PIL-backend classes: torchvision, which the default backends need,
has no build for the CPU torch of our machines (`AutoImageProcessor` loads either).
"""

from __future__ import annotations

from pathlib import Path

import torch

_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def _fast_tokenizer(tokenizer):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def build_tiny_clip(folder: str | Path, corpus: list[str], *, image_size: int = 32, seed: int = 0) -> Path:
    """A random `CLIPModel` with a word-level tokenizer and a CLIP image processor in one folder.

    Args:
        folder: where to save (created).
        corpus: text the tokenizer learns its words from (prompts).
        image_size: the vision tower's input side in pixels.
        seed: initialisation seed.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import CLIPConfig, CLIPModel
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    folder = Path(folder)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=_SPECIALS))
    bos, eos, pad = (tok.token_to_id(t) for t in ("<s>", "</s>", "<pad>"))
    # CLIP pools the text at the end-of-text token, so every sequence must carry one.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", bos), ("</s>", eos)]
    )
    _fast_tokenizer(tok).save_pretrained(folder)
    CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    ).save_pretrained(folder)
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=tok.get_vocab_size(),
            max_position_embeddings=32,
            pad_token_id=pad,
            bos_token_id=bos,
            eos_token_id=eos,
            **tiny,
        ),
        vision_config=dict(image_size=image_size, patch_size=8, **tiny),
        projection_dim=16,
    )
    torch.manual_seed(seed)
    CLIPModel(config).save_pretrained(folder)
    return folder


def build_tiny_ocr_reader(folder: str | Path, corpus: list[str], *, image_size: int = 32, seed: int = 0) -> Path:
    """A random TrOCR-style reader: ViT encoder + TrOCR decoder, a byte-level BPE tokenizer, `TrOCRProcessor`.

    Its generation config bans the padding, start and unknown tokens, so that the random reader
    emits text (or stops) rather than only special tokens.

    Args:
        folder: where to save (created).
        corpus: text the tokenizer learns its merges from (the quoted texts).
        image_size: the encoder's input side in pixels.
        seed: initialisation seed.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        GenerationConfig,
        TrOCRConfig,
        TrOCRProcessor,
        VisionEncoderDecoderConfig,
        VisionEncoderDecoderModel,
        ViTConfig,
    )
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    folder = Path(folder)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # Byte-level: any text round-trips through encode and decode, spaces included.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    tokenizer = _fast_tokenizer(tok)
    image_processor = ViTImageProcessorPil(size={"height": image_size, "width": image_size})
    TrOCRProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)

    ids = dict(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    encoder = ViTConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=image_size,
        patch_size=8,
    )
    decoder = TrOCRConfig(
        vocab_size=len(tokenizer),
        d_model=32,
        decoder_layers=1,
        decoder_attention_heads=2,
        decoder_ffn_dim=64,
        max_position_embeddings=128,
        decoder_start_token_id=ids["bos_token_id"],
        **ids,
    )
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id = ids["bos_token_id"]
    config.pad_token_id, config.eos_token_id = ids["pad_token_id"], ids["eos_token_id"]
    torch.manual_seed(seed)
    model = VisionEncoderDecoderModel(config=config)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=ids["bos_token_id"],
        bad_words_ids=[[ids["pad_token_id"]], [ids["bos_token_id"]], [tokenizer.unk_token_id]],
        **ids,
    )
    model.save_pretrained(folder)
    return folder


def build_tiny_got_ocr(folder: str | Path, corpus: list[str], *, seed: int = 0) -> Path:
    """A random GOT-OCR 2.0 reader (decoder-only: SAM-style vision tower, Qwen2 decoder) with `GotOcr2Processor`.

    The processor writes its own OCR prompt with 256 image tokens (a fixed number in GOT), so the
    vision tower must yield a 16x16 grid after its two stride-2 convolutions: 128-pixel images in
    2-pixel patches. Its generation config bans every special token but the end of turn.

    Args:
        folder: where to save (created).
        corpus: text the tokenizer learns its merges from (the quoted texts).
        seed: initialisation seed.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        GenerationConfig,
        GotOcr2Config,
        GotOcr2ForConditionalGeneration,
        GotOcr2Processor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    folder = Path(folder)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<imgpad>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=specials[1:6],
    )
    image_processor = GotOcr2ImageProcessorPil(size={"height": 128, "width": 128})
    GotOcr2Processor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)

    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in specials}
    config = GotOcr2Config(
        vision_config=dict(
            hidden_size=16,
            output_channels=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=128,
            patch_size=2,
            window_size=8,
            global_attn_indexes=[],
            mlp_dim=32,
        ),
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=512,
            bos_token_id=ids["<|im_start|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        image_token_index=ids["<imgpad>"],
        image_seq_length=256,
    )
    torch.manual_seed(seed)
    model = GotOcr2ForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        bad_words_ids=[[ids[s]] for s in specials if s != "<|im_end|>"],
    )
    model.save_pretrained(folder)
    return folder


def build_tiny_detector(folder: str | Path, labels: list[str], *, image_size: int = 64, seed: int = 0) -> Path:
    """A random `DetrForObjectDetection` (2-stage ResNet backbone, one encoder and decoder layer).

    Args:
        folder: where to save (created).
        labels: class names (`config.id2label`); prompts name objects by them.
        image_size: the image processor resizes images to this side.
        seed: initialisation seed.
    """
    from transformers import DetrConfig, DetrForObjectDetection, ResNetConfig
    from transformers.models.detr.image_processing_pil_detr import DetrImageProcessorPil

    folder = Path(folder)
    backbone = ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", out_features=["stage2"]
    )
    config = DetrConfig(
        backbone_config=backbone,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        num_queries=12,
        id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)},
    )
    torch.manual_seed(seed)
    DetrForObjectDetection(config).save_pretrained(folder)
    DetrImageProcessorPil(size={"shortest_edge": image_size, "longest_edge": image_size}).save_pretrained(folder)
    return folder
