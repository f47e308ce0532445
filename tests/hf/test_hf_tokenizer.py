"""`foldtune data prepare --tokenizer DIR`: a tiny BPE trained in-process (offline) tokenizes the documents,
each followed by the EOS id, stored as uint16 (vocab > 256); the sampler reads the ids back; the byte tokenizer
stays the default."""

from __future__ import annotations

import json

import pytest

from api.cli.main import main
from executor.dataset.hf_tokenizer import HFTokenizer, TokenizerError, token_dtype
from executor.dataset.sampler import TokenDataset

tokenizers = pytest.importorskip("tokenizers")
DOCS = ["the quick brown fox jumps over the lazy dog " * 20, "pack my box with five dozen liquor jugs " * 20]


def _tiny_bpe(directory, vocab_size=300, eos="</s>"):
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", eos],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS, trainer)
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return tok


def test_prepare_with_a_local_tokenizer(tmp_path, capsys):
    tok = _tiny_bpe(tmp_path / "tok")
    for i, text in enumerate(DOCS):
        (tmp_path / f"doc{i}.txt").write_text(text)
    out = tmp_path / "data"
    code = main(["data", "prepare", str(tmp_path / "doc0.txt"), str(tmp_path / "doc1.txt"), "--out", str(out),
                 "--tokenizer", str(tmp_path / "tok")])
    assert code == 0
    assert "uint16 ids" in capsys.readouterr().out
    index = json.loads((out / "index.json").read_text())
    eos = tok.token_to_id("</s>")
    assert index["dtype"] == "uint16" and index["eos_id"] == eos and index["vocab_size"] == tok.get_vocab_size()
    dataset = TokenDataset(out)
    heldout = dataset.splits["heldout"].read(0, dataset.splits["heldout"].tokens)
    train = dataset.splits["train"].read(0, dataset.splits["train"].tokens)
    # document i is its training tokens then its held-out tokens; each held-out part ends with EOS
    assert int((heldout == eos).sum()) == 2 and int((train == eos).sum()) == 0
    whole = tok.encode(DOCS[0].strip()).ids + [eos]
    cut = len(whole) - max(1, int(len(whole) * 0.1))
    assert train[:cut].tolist() == whole[:cut] and heldout[: len(whole) - cut].tolist() == whole[cut:]
    assert int(train.max()) > 255  # ids a uint8 could not hold


def test_dtype_and_eos_rules(tmp_path):
    assert [token_dtype(v) for v in (256, 257, 65536, 65537, 201088)] == ["uint8", "uint16", "uint16", "uint32",
                                                                          "uint32"]
    _tiny_bpe(tmp_path / "tok", eos="<|endoftext|>")
    (tmp_path / "tok" / "tokenizer_config.json").unlink()
    assert HFTokenizer(tmp_path / "tok").eos_id == HFTokenizer(tmp_path / "tok" / "tokenizer.json").eos_id
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        HFTokenizer(tmp_path / "tok", eos_id=10**6)
    with pytest.raises(TokenizerError, match="cannot load tokenizer"):
        HFTokenizer(tmp_path / "missing")
    _tiny_bpe(tmp_path / "noeos", eos="<end>")
    (tmp_path / "noeos" / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerError, match="no end-of-sequence token"):
        HFTokenizer(tmp_path / "noeos")
