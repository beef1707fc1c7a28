"""Readers for .jsonl/.json instruction and chat data: the four shapes and every refusal, named by file and line."""
import json

import pytest

from minigpt.errors import InputError
from minituner.sft.files import is_structured, read_file, read_records
from minituner.sft.formats import FORMATS, DataSelection, split_records

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_text_shape(tmp_path):
    (r,) = read_file(write_jsonl(tmp_path / "a.jsonl", [{"text": "some text", "id": 3}]))
    assert (r.format, r.kind, r.text, r.where) == ("text", "text", "some text", f"{tmp_path / 'a.jsonl'}:1")


def test_prompt_completion_shape(tmp_path):
    (r,) = read_file(write_jsonl(tmp_path / "a.jsonl", [{"prompt": "2+2=", "completion": "4"}]))
    assert (r.format, r.kind, r.prompt, r.completion) == ("prompt-completion", "completion", "2+2=", "4")


def test_conversational_prompt_completion_is_a_chat(tmp_path):
    row = {"prompt": CHAT[:2], "completion": CHAT[2:]}
    (r,) = read_file(write_jsonl(tmp_path / "a.jsonl", [row]))
    assert r.kind == "chat" and list(r.messages) == CHAT


def test_messages_shape(tmp_path):
    (r,) = read_file(write_jsonl(tmp_path / "a.jsonl", [{"messages": CHAT}]))
    assert (r.format, r.kind) == ("messages", "chat") and list(r.messages) == CHAT


def test_messages_keep_their_other_fields(tmp_path):
    row = {"messages": [{"role": "user", "content": "hi", "name": "ann", "x": None},
                        {"role": "assistant", "content": "ok"}]}
    (r,) = read_file(write_jsonl(tmp_path / "a.jsonl", [row]))
    assert r.messages[0] == {"role": "user", "content": "hi", "name": "ann"}


def test_alpaca_shape_with_and_without_input(tmp_path):
    rows = [{"instruction": "Add.", "input": "2 and 2", "output": "4"}, {"instruction": "Say hi.", "output": "hi"},
            {"instruction": "Say hi.", "input": "", "output": "hi"}]
    a, b, c = read_file(write_jsonl(tmp_path / "a.jsonl", rows))
    assert a.format == "alpaca" and a.kind == "chat"
    assert list(a.messages) == [{"role": "user", "content": "Add.\n\n2 and 2"}, {"role": "assistant", "content": "4"}]
    assert b.messages == c.messages == ({"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"})


def test_sharegpt_shape_reads_as_messages(tmp_path):
    rows = [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi?"},
                               {"from": "gpt", "value": "Hello."}], "id": "x1"},
            {"system": "Be brief.", "conversations": [{"from": "Human", "value": "Hi?"},
                                                      {"from": "GPT", "value": "Hello.", "weight": 1}]},
            {"conversations": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}]
    a, b, c = read_file(write_jsonl(tmp_path / "a.jsonl", rows))
    assert (a.format, a.kind) == ("sharegpt", "chat") and list(a.messages) == CHAT
    assert list(b.messages) == CHAT[:2] + [{**CHAT[2], "weight": 1}]  # the system field is the first turn
    assert list(c.messages) == CHAT[1:]
    tool = {"conversations": [{"from": "human", "value": "Weather?"}, {"from": "observation", "value": "rain"},
                              {"from": "gpt", "value": "Rain."}], "system": ""}
    (t,) = read_file(write_jsonl(tmp_path / "t.jsonl", [tool]))
    assert [m["role"] for m in t.messages] == ["user", "tool", "assistant"]


def test_sharegpt_renders_as_the_same_messages(tmp_path):
    """Through the template and the tokenizer a ShareGPT record and its messages twin are the same example."""
    from minigpt.tokenizer import CharTokenizer
    from minituner.sft import default_template, tokenize_records

    share = {"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]}
    (a,) = read_file(write_jsonl(tmp_path / "a.jsonl", [share]))
    (b,) = read_file(write_jsonl(tmp_path / "b.jsonl", [{"messages": CHAT[1:]}]))
    tok = CharTokenizer.train("User: Assistant: Hi?Hello.\n<|end|>")
    (ea,), _ = tokenize_records([a], tok, default_template(), 64)
    (eb,), _ = tokenize_records([b], tok, default_template(), 64)
    assert (ea.input_ids, ea.labels) == (eb.input_ids, eb.labels) and sum(t >= 0 for t in ea.labels) > 5


def test_json_array_has_line_numbers(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('[\n  {"prompt": "a", "completion": "b"},\n  {"prompt": "c",\n   "completion": "d"}\n]\n')
    recs = read_file(p)
    assert [r.where for r in recs] == [f"{p}:2", f"{p}:3"] and recs[1].completion == "d"


def test_json_file_with_one_object_per_line(tmp_path):
    recs = read_file(write_jsonl(tmp_path / "a.json", [{"text": "x"}, {"text": "y"}]))
    assert [r.text for r in recs] == ["x", "y"]


def test_folder_reads_files_in_order_each_its_own_shape(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [{"messages": CHAT}])
    write_jsonl(tmp_path / "a.jsonl", [{"text": "t"}, {"text": "u"}])
    (tmp_path / "notes.log").write_text("ignored")
    (tmp_path / ".hidden.jsonl").write_text("not json")
    recs = read_records(tmp_path)
    assert [r.format for r in recs] == ["text", "text", "messages"]
    assert is_structured(tmp_path) and is_structured(tmp_path / "a.jsonl") and not is_structured(tmp_path / "notes.log")
    (tmp_path / "notes.txt").write_text("would be skipped")
    with pytest.raises(InputError, match=r"holds data files and text files \(notes.txt\)"):
        read_records(tmp_path)
    hidden_only = tmp_path / "h"
    hidden_only.mkdir()
    (hidden_only / ".x.jsonl").write_text("{}")
    assert not is_structured(hidden_only)


def test_line_separator_inside_a_string_keeps_line_numbers(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"text": "a\u2028b"}\n{"bad": 1}\n', encoding="utf-8")
    with pytest.raises(InputError, match=r"a\.jsonl:2: fields found: bad"):
        read_file(p)


def test_forced_format(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"text": "t", "prompt": "p", "completion": "c"}])
    assert read_file(p)[0].kind == "completion"  # detected: prompt-completion wins over text
    assert read_file(p, "text")[0].text == "t"
    with pytest.raises(InputError, match=r"a\.jsonl:1: fields found: completion, prompt, text; expected alpaca"):
        read_file(p, "alpaca")
    with pytest.raises(InputError, match="unknown data format 'csv'"):
        read_file(p, "csv")
    assert set(FORMATS) == {"text", "prompt-completion", "messages", "alpaca", "sharegpt"}


@pytest.mark.parametrize("rows, message", [
    ([{"text": "ok"}, {"question": "q", "answer": "a"}],
     r"a\.jsonl:2: fields found: answer, question; expected text \(it fits none of"),
    ([{"foo": 1}], r"a\.jsonl:1: fields found: foo; a record needs 'text'"),
    ([{"text": "ok"}, {"prompt": "p", "completion": "c"}], r"a\.jsonl:2: fields found: completion, prompt; "
                                                           r"expected text \(it looks like prompt-completion\)"),
    ([{"prompt": "p", "completion": ""}], r"a\.jsonl:1: empty completion"),
    ([{"prompt": "p", "completion": "  \n"}], r"a\.jsonl:1: empty completion"),
    ([{"prompt": "p", "completion": 4}], r"a\.jsonl:1: field 'completion' must be a string, got int"),
    ([{"instruction": "i", "output": ""}], r"a\.jsonl:1: empty output"),
    ([{"text": ""}], r"a\.jsonl:1: empty text"),
    ([{"messages": CHAT[:2]}], r"a\.jsonl:1: the conversation has no assistant turn"),
    ([{"messages": CHAT[:2] + [{"role": "assistant", "content": ""}]}],
     r"a\.jsonl:1: messages\[2\] is an empty assistant"),
    ([{"messages": [{"role": "user", "text": "hi"}]}],
     r"a\.jsonl:1: messages\[0\] must be an object with string 'role' and 'content' \(found role, text\)"),
    ([{"messages": [{"role": "bot", "content": "hi"}]}], r"a\.jsonl:1: messages\[0\] has role 'bot'"),
    ([{"messages": []}], r"a\.jsonl:1: 'messages' must be a non-empty list"),
    ([[1, 2]], r"a\.jsonl:1: expected a JSON object, got list"),
    ([{"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "ok"}]}],
     r"a\.jsonl:1: conversations\[1\] is from 'bot'; speakers are system, human"),
    ([{"conversations": [{"from": "human", "text": "hi"}]}],
     r"a\.jsonl:1: conversations\[0\] must be an object with string 'from' and 'value' \(found from, text\)"),
    ([{"conversations": "hi"}], r"a\.jsonl:1: 'conversations' must be a non-empty list"),
    ([{"conversations": [{"from": "human", "value": "hi"}]}], r"a\.jsonl:1: the conversation has no assistant"),
    ([{"system": "s", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": " "}]}],
     r"a\.jsonl:1: conversations\[1\] is an empty assistant"),
    ([{"system": 3, "conversations": [{"from": "gpt", "value": "a"}]}], r"a\.jsonl:1: field 'system' must be a string"),
])
def test_bad_records_are_refused_with_file_and_line(tmp_path, rows, message):
    with pytest.raises(InputError, match=message):
        read_file(write_jsonl(tmp_path / "a.jsonl", rows))


def test_malformed_json_line(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"text": "ok"}\n\n{"text": "cut\n')
    with pytest.raises(InputError, match=r"a\.jsonl:3: not valid JSON"):
        read_file(p)


def test_malformed_json_array(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('[\n {"text": "a"}\n {"text": "b"}\n]')
    with pytest.raises(InputError, match=r"a\.json:3: expected ',' or ']'"):
        read_file(p)


@pytest.mark.parametrize("after,line", [('\n[{"text": "c"}]\n', 3), ('\n{"text": "c"}', 3), (" xyz", 2)])
def test_anything_after_the_json_array_is_refused(tmp_path, after, line):
    """Records past the array's ']' (a second array, an object) would go unread; json.load refuses them too."""
    p = tmp_path / "a.json"
    p.write_text('[{"text": "a"},\n {"text": "b"}]' + after)
    with pytest.raises(InputError, match=rf"a\.json:{line}: more after the JSON array's closing"):
        read_file(p)
    p.write_text('[{"text": "a"},\n {"text": "b"}] \r\n\n')
    assert [r.text for r in read_file(p)] == ["a", "b"]


def test_non_utf8_bytes_are_refused_with_the_line(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(InputError, match=r"a\.jsonl:2: not UTF-8 \(byte 0xe9 at column 14\)"):
        read_file(p)


def test_utf8_bom_is_accepted(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"text": "x"}\n')
    assert read_file(p)[0].text == "x"


def test_empty_and_missing(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(InputError, match=r"e\.jsonl: no records"):
        read_file(tmp_path / "e.jsonl")
    with pytest.raises(InputError, match="not found"):
        read_records(tmp_path / "missing.jsonl")
    (tmp_path / "d").mkdir()
    with pytest.raises(InputError, match="no .jsonl, .json, .csv, .parquet or .arrow files"):
        read_records(tmp_path / "d")


def test_split_records_is_deterministic_and_disjoint(tmp_path):
    recs = read_file(write_jsonl(tmp_path / "a.jsonl", [{"text": str(i)} for i in range(45)]))
    s = split_records(recs)
    assert [len(s[k]) for k in ("train", "val", "test")] == [41, 2, 2]
    assert [r.text for r in s["val"]] == ["18", "38"] and [r.text for r in s["test"]] == ["19", "39"]
    small = split_records(recs[:7])
    assert [r.text for r in small["val"]] == ["4"] and len(small["train"]) == 6 and small["test"] == []


def test_a_system_field_is_the_first_turn_of_a_chat_and_refused_where_nothing_renders_it(tmp_path):
    """alpaca (LLaMA-Factory's system and history), messages and conversational prompt-completion read a record's
    system field as the first turn; it may repeat the chat's own first system turn, not contradict it; a text or
    plain prompt-completion record has no template to render it, so it is refused rather than dropped."""
    alpaca = {"instruction": "wind?", "input": "Bergen", "output": "7", "system": "be brief",
              "history": [["hi", "hello"]]}
    (r,) = read_file(write_jsonl(tmp_path / "a.jsonl", [alpaca]))
    assert [(m["role"], m["content"]) for m in r.messages] == [
        ("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("user", "wind?\n\nBergen"),
        ("assistant", "7")]
    (r,) = read_file(write_jsonl(tmp_path / "m.jsonl", [{"messages": CHAT[1:], "system": "Be brief."}]))
    assert r.messages == tuple(CHAT)
    (r,) = read_file(write_jsonl(tmp_path / "same.jsonl", [{"messages": CHAT, "system": "Be brief."}]))
    assert r.messages == tuple(CHAT)
    (r,) = read_file(write_jsonl(tmp_path / "c.jsonl", [{"prompt": CHAT[1:2], "completion": CHAT[2:], "system": "s"}]))
    assert r.messages[0] == {"role": "system", "content": "s"} and r.answers_from == 2
    for name, record, message in (
            ("x.jsonl", {"messages": CHAT, "system": "Be long."}, "a 'system' field and a first system turn that differ"),
            ("t.jsonl", {"text": "abc", "system": "s"}, "a 'system' field in a text record"),
            ("p.jsonl", {"prompt": "a", "completion": "b", "system": "s"}, "in a prompt-completion record"),
            ("h.jsonl", {**alpaca, "history": [["only a question"]]}, "'history' must be a list of"),
            ("s.jsonl", {**alpaca, "system": 3}, "field 'system' must be a string, got int")):
        with pytest.raises(InputError, match=rf"{name}:1: .*{message}"):
            read_file(write_jsonl(tmp_path / name, [record]))
    (r,) = read_file(write_jsonl(tmp_path / "empty.jsonl", [{"text": "abc", "system": ""}]))  # an empty column
    assert r.text == "abc"


def test_a_system_column_named_by_columns_is_read(tmp_path):
    rows = [{"q": "wind?", "a": "7", "sys": "be brief"}]
    recs = read_records(write_jsonl(tmp_path / "a.jsonl", rows),
                        selection=DataSelection(columns=(("instruction", "q"), ("output", "a"), ("system", "sys"))))
    assert recs[0].messages[0] == {"role": "system", "content": "be brief"}


@pytest.mark.parametrize("turn,message", [
    ({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
     r"messages\[1\] is an assistant's tool call \('tool_calls'\)"),
    ({"role": "assistant", "content": [{"type": "text", "text": "hi"}]}, r"messages\[1\] .*\('content' is a list\)"),
    ({"role": "assistant", "content": None}, r"\('content' is null\)"),
    ({"role": "assistant", "content": "7", "weight": 0.5}, r"messages\[1\]: weight 0\.5; a turn's weight is 0"),
    ({"role": "assistant", "content": "7", "weight": True}, r"weight True"),
])
def test_turns_refused_say_what_is_wrong(tmp_path, turn, message):
    with pytest.raises(InputError, match=message):
        read_file(write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "user", "content": "q"}, turn]}]))


def test_weight_1_on_a_user_turn_is_refused(tmp_path):
    conv = [{"from": "human", "value": "q", "weight": 1}, {"from": "gpt", "value": "a", "weight": 0}]
    with pytest.raises(InputError, match=r"conversations\[0\]: weight 1 on a user turn: only answers count"):
        read_file(write_jsonl(tmp_path / "a.jsonl", [{"conversations": conv}]))
    conv[0]["weight"] = 0
    with pytest.raises(InputError, match=r"a\.jsonl:1: every assistant turn of the conversation has weight 0"):
        read_file(write_jsonl(tmp_path / "a.jsonl", [{"conversations": conv}]))
    prompt = [CHAT[1], {**CHAT[2], "weight": 1}, CHAT[1]]  # an answer inside a prompt is context
    with pytest.raises(InputError, match=r"weight 1 on prompt turn 1: only the completion's answers count"):
        read_file(write_jsonl(tmp_path / "a.jsonl", [{"prompt": prompt, "completion": [CHAT[2]]}]))
