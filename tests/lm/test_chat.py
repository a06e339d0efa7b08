"""Conversations (--conversation_column): the chat template's tokens, the loss on the assistant's
turns only, checked against a tokenization of the template's pieces one by one."""

import json

import numpy as np
import pytest
import torch

from assay.cli import main
from assay.core.config import DataConfig
from assay.core.errors import AssayError
from assay.lm.data import Examples, collate, examples_fingerprint, load_examples
from assay.lm.packing import pack
from tests.helpers import make_chat_tokenizer, random_examples, tiny_llama

CONVERSATIONS = [
    [
        {"role": "user", "content": "the king walks"},
        {"role": "assistant", "content": "over fields."},
    ],
    [  # the reply also appears in the user's turn: only the assistant's copy carries loss
        {"role": "system", "content": "cold grey skies"},
        {"role": "user", "content": "rivers run"},
        {"role": "assistant", "content": "rivers run"},
        {"role": "user", "content": "and the queen?"},
        {"role": "assistant", "content": "the queen of night walks slowly"},
    ],
]


@pytest.fixture(scope="module")
def chat_tokenizer():
    return make_chat_tokenizer()


@pytest.fixture
def chats(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c, "n": i}) + "\n" for i, c in enumerate(CONVERSATIONS)))
    return path


def reference(tok, convo):
    """(tokens, loss mask) from ChatML's pieces tokenized one by one (their boundaries are
    pre-token boundaries of this byte-level tokenizer): the assistant's text and <|im_end|>."""
    ids, mask = [], []
    for m in convo:
        reply = m["role"] == "assistant"
        pieces = (
            (f"<|im_start|>{m['role']}\n", False),
            (m["content"], reply),
            ("<|im_end|>", reply),
            ("\n", False),
        )
        for piece, target in pieces:
            toks = tok(piece, add_special_tokens=False)["input_ids"]
            ids += toks
            mask += [target] * len(toks)
    mask[0] = False
    return np.array(ids), np.array(mask)


def test_only_the_assistant_turns_carry_loss(chats, chat_tokenizer):
    cfg = DataConfig(dataset=str(chats), conversation_column="messages")
    _, ex = load_examples(cfg, chat_tokenizer)
    for i, convo in enumerate(CONVERSATIONS):
        ids, mask = reference(chat_tokenizer, convo)
        np.testing.assert_array_equal(ex.tokens_of(i), ids)
        np.testing.assert_array_equal(ex.targets_of(i), mask)
    assert ex.num_loss_tokens().tolist() == [
        int(reference(chat_tokenizer, c)[1].sum()) for c in CONVERSATIONS
    ]
    batch = collate(ex, np.arange(len(ex)), 0)
    for i in range(len(ex)):
        n = int(ex.lengths[i])
        expected = np.where(ex.targets_of(i), ex.tokens_of(i), -100)
        np.testing.assert_array_equal(batch["labels"][i, :n].numpy(), expected)
    packed = pack(ex, np.arange(len(ex)))["labels"][0].numpy()
    np.testing.assert_array_equal(
        packed[: int(ex.lengths.sum())],
        np.concatenate([np.where(ex.targets_of(i), ex.tokens_of(i), -100) for i in range(len(ex))]),
    )


def test_truncation_cuts_the_mask_with_the_tokens(chats, chat_tokenizer):
    _, ex = load_examples(
        DataConfig(dataset=str(chats), conversation_column="messages", max_length=30), chat_tokenizer
    )
    for i, convo in enumerate(CONVERSATIONS):
        ids, mask = reference(chat_tokenizer, convo)
        np.testing.assert_array_equal(ex.tokens_of(i), ids[:30])
        np.testing.assert_array_equal(ex.targets_of(i), mask[:30])


def test_the_eval_loss_is_over_the_replies_tokens(chats, chat_tokenizer, tmp_path):
    model_dir = tmp_path / "chat-llama"
    tiny_llama(vocab_size=len(chat_tokenizer)).save_pretrained(model_dir)
    chat_tokenizer.save_pretrained(model_dir)
    out = tmp_path / "ev"
    args = ["eval", str(out), "--model", str(model_dir), "--dataset", str(chats), "--precision", "fp32"]
    assert main([*args, "--conversation_column", "messages"]) == 0
    rows = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    model = tiny_llama(vocab_size=len(chat_tokenizer))
    for row, convo in zip(rows, CONVERSATIONS):
        ids, mask = reference(chat_tokenizer, convo)
        with torch.no_grad():
            logits = model(torch.tensor(ids)[None]).logits[0, :-1]
        losses = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
        assert row["tokens"] == int(mask.sum())  # losses.jsonl holds each example's summed loss
        assert row["loss"] == pytest.approx(float(losses[torch.tensor(mask[1:])].sum()), rel=1e-5)


def test_bad_conversations_are_one_clear_line(tmp_path, chat_tokenizer, tiny_tokenizer):
    path = tmp_path / "c.jsonl"
    path.write_text(
        json.dumps({"messages": CONVERSATIONS[0]}) + "\n" + json.dumps({"messages": "hello"}) + "\n"
    )
    cfg = DataConfig(dataset=str(path), conversation_column="messages")
    with pytest.raises(AssayError, match=r"row 1 is not a conversation"):
        load_examples(cfg, chat_tokenizer)
    with pytest.raises(AssayError, match=r"row 1 is not a conversation"):  # the rows are read first
        load_examples(cfg, tiny_tokenizer)
    path.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    with pytest.raises(AssayError, match="no chat template"):
        load_examples(cfg, tiny_tokenizer)
    rewritten = make_chat_tokenizer()
    rewritten.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    with pytest.raises(AssayError, match="rewrites an assistant message"):
        load_examples(DataConfig(dataset=str(path), conversation_column="messages", max_samples=1), rewritten)
    with pytest.raises(AssayError, match="not both"):
        DataConfig(conversation_column="m", prompt_column="p", completion_column="c")


def test_examples_with_a_mask_round_trip_and_concatenate(tmp_path, chats, chat_tokenizer):
    _, chat = load_examples(DataConfig(dataset=str(chats), conversation_column="messages"), chat_tokenizer)
    chat.save(tmp_path / "e.npz")
    again = Examples.load(tmp_path / "e.npz")
    assert examples_fingerprint(again) == examples_fingerprint(chat)
    plain = random_examples([5, 7], loss_start=[2, 3])
    both = Examples.concatenate([plain, chat], [np.array([1]), np.array([1, 0])])
    assert both.ids.tolist() == [1, 1, 0]
    np.testing.assert_array_equal(both.targets_of(0), np.arange(7) >= 3)
    np.testing.assert_array_equal(both.targets_of(1), chat.targets_of(1))
    np.testing.assert_array_equal(both.tokens_of(2), chat.tokens_of(0))
    assert both.num_loss_tokens().tolist() == [4, *chat.num_loss_tokens()[[1, 0]].tolist()]
    assert plain.subset([1, 0]).loss_mask is None  # examples without a mask keep none


def test_a_plain_datasets_fingerprint_is_unchanged():
    """Indexes store examples_fingerprint: data without a mask must hash as it always has."""
    import hashlib

    ex = random_examples([4, 6], loss_start=[1, 2])
    h = hashlib.sha256(b"set")
    for arr in (ex.ids, ex.offsets, ex.tokens, ex.loss_start):
        h.update(f"{arr.dtype}{arr.shape}".encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    assert examples_fingerprint(ex) == h.hexdigest()[:16]


def test_build_and_score_conversations(tmp_path, chat_tokenizer):
    """An index of conversations, queried by its own conversations: each is its own top proponent,
    and the texts shown are the messages."""
    from tests.helpers import WORDS

    rng = np.random.default_rng(0)
    words = lambda n: " ".join(rng.choice(WORDS, size=n))  # noqa: E731
    path = tmp_path / "many.jsonl"
    rows = [
        [{"role": "user", "content": words(4)}, {"role": "assistant", "content": words(8)}] for _ in range(12)
    ]
    path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    model_dir = tmp_path / "chat-llama"
    tiny_llama(vocab_size=len(chat_tokenizer)).save_pretrained(model_dir)
    chat_tokenizer.save_pretrained(model_dir)
    chat = ["--dataset", str(path), "--conversation_column", "messages"]
    flags = ["--precision", "fp32", "--projection_dim", "8", "--normalizer_samples", "4"]
    assert main(["build", str(tmp_path / "ix"), "--model", str(model_dir), *chat, *flags]) == 0
    out = tmp_path / "sc"
    query = [
        "--query_dataset",
        str(path),
        "--query_conversation_column",
        "messages",
        "--query_max_samples",
        "3",
    ]
    assert main(["score", str(out), "--index", str(tmp_path / "ix"), *query]) == 0
    records = [json.loads(line) for line in (out / "top.jsonl").read_text().splitlines()]
    assert [r["proponents"][0][0] for r in records] == [0, 1, 2]
    shown = json.loads((out / "queries.jsonl").read_text().splitlines()[0])["text"]
    assert shown == f"user: {rows[0][0]['content']}\nassistant: {rows[0][1]['content']}"
