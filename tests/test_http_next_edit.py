"""POST /v1/edit/completions (dlm_lsp/http/nextedit.py, dlm_lsp/http/unidiff.py): the next-edit request
Continue's Next Edit sends to Inception's Mercury, answered by the language server's own next-edit
path (suggest.judge over the engine's EditJob for the marked region). Requests are written here the
way Continue writes them (core/nextEdit/templating/mercuryCoderNextEdit.ts, providers/
MercuryCoderNextEditProvider.ts, llm/llms/Inception.ts; diffs from npm `diff`'s createPatch with
its first two lines dropped), answers read the way Continue reads them. The scripted engine
(rewrite=old>new) makes the rewrite exact; its `hold` folder orders "the job is running" by events."""

from __future__ import annotations

import difflib
import json
import re
import socket
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from dlm_lsp.http.fim import ApiError, Limits
from dlm_lsp.http.nextedit import MAX_REGION_CHARS, parse_body, parse_prompt
from dlm_lsp.http.unidiff import hunks, recent_edits
from engine.api import EditJob
from tests.test_http import Running, post

PATH = "/v1/edit/completions"
FILE = "src/stats.py"
BEFORE = (
    "def mean(values):\n"
    "    total = 0\n"
    "    for v in values:\n"
    "        total += v\n"
    "    count = len(values)\n"
    "    return total / count\n"
    "\n"
    "\n"
    "def spread(values):\n"
    "    return max(values) - min(values)\n"
)
PRINTED = BEFORE + "\n\nprint(mean([1, 2, 3]))\n"
RENAMED = PRINTED.replace("    total = 0", "    acc = 0")  # the user's last edit: total -> acc, on line 1
CURSOR = (2, 4)  # line, character: the start of "for" on the line after the rename
SYSTEM = "You are Mercury, a coding assistant by Inception Labs: rewrite the code between the markers."


ENGINE = (
    "surprise+memory"  # an engine layout: the scripted engine's rewrite comes back (the default, propagate, needs none)
)


def create_patch(path: str, before: str, after: str) -> str:
    """npm `diff`'s createPatch(path, before, after, "before", "after", {context: 3}), as Continue
    builds it: both texts end with a break; an Index line and a rule, then the unified diff with
    counts on every range."""
    before, after = (t if t.endswith("\n") else t + "\n" for t in (before, after))
    lines = difflib.unified_diff(
        before.splitlines(), after.splitlines(), path, path, "before", "after", n=3, lineterm=""
    )
    body = [re.sub(r"^@@ -(\d+) ", r"@@ -\1,1 ", re.sub(r" \+(\d+) @@", r" +\1,1 @@", ln)) for ln in lines]
    return "\n".join([f"Index: {path}", "=" * 67, *body]) + "\n"


def continue_prompt(
    text: str,
    cursor: tuple[int, int],
    region: tuple[int, int],
    history: list[tuple[str, str]],
    snippets: Sequence[tuple[str, str]] = (("src/util.py", "def helper():\n    return 1"),),
) -> str:
    """The user message of Continue's Mercury next-edit request (without the unique token its
    Inception client strips): snippets, the file with the cursor and region markers, the diffs."""
    block = "\n".join(
        "\n".join(
            ["<|recently_viewed_code_snippet|>", f"code_snippet_file_path: {p}", c, "<|/recently_viewed_code_snippet|>"]
        )
        for p, c in snippets
    )
    lines = text.split("\n")
    line, char = cursor
    lines[line] = lines[line][:char] + "<|cursor|>" + lines[line][char:]
    first, last = region
    marked = [*lines[:first], "<|code_to_edit|>", *lines[first : last + 1], "<|/code_to_edit|>", *lines[last + 1 :]]
    diffs = "\n".join("\n".join(create_patch(FILE, a, b).split("\n")[2:]) for a, b in history)
    return (
        "<|recently_viewed_code_snippets|>\n" + block + "\n<|/recently_viewed_code_snippets|>\n\n"
        "<|current_file_content|>\ncurrent_file_path: "
        + FILE
        + "\n"
        + "\n".join(marked)
        + "\n<|/current_file_content|>\n\n"
        "<|edit_diff_history|>\n" + diffs + "\n<|/edit_diff_history|>\n"
    )


def continue_body(prompt: str, stream: bool = True, model: str = "dlm-test", **extra) -> dict:
    """The body Continue's Inception client posts (undefined options dropped, as JSON.stringify drops them)."""
    return {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
        "max_tokens": 4096,
        "temperature": 0.0,
        "presence_penalty": 1.5,
        "stop": ["<|endoftext|>"],
        "stream": stream,
        **extra,
    }


def region_of(text: str, region: tuple[int, int]) -> str:
    return "\n".join(text.split("\n")[region[0] : region[1] + 1])


def extract(content: str) -> str:
    """What Continue's Mercury provider takes from the answer: between the first "```\\n" and the last "\\n\\n```"."""
    return content[content.index("```\n") + 4 : content.rindex("\n\n```")]


def stream_content(url: str, body: dict) -> tuple[str, list[dict]]:
    """The concatenated delta contents of a streamed answer (as Continue concatenates them) and the chunks."""
    with httpx.stream("POST", url + PATH, json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"])
    return text, chunks


def wait_for(condition, what: str, within: float = 20.0) -> None:
    end = time.monotonic() + within
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


class CharTokenizer:
    """A token per character: what the server counts a region's tokens with."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [[ord(c) for c in t] for t in texts]


REGION = (2, 7)  # Mercury's window in Continue: the cursor's line and 5 below
HISTORY = [(BEFORE, PRINTED), (PRINTED, RENAMED)]


# ----------------------------------------------------------------------------- pure parts


def test_the_prompt_reads_back_into_the_document_cursor_region_and_diffs():
    prompt = continue_prompt(RENAMED, CURSOR, REGION, HISTORY)
    p = parse_prompt(prompt + "<|!@#IS_NEXT_EDIT!@#|>")  # the token Continue's client strips, if it arrives
    assert p.path == FILE and p.text == RENAMED
    assert p.cursor == RENAMED.index("for v in") and p.region == region_of(RENAMED, REGION)
    assert p.start == RENAMED.index("    for v in") and p.diffs.startswith("--- src/stats.py\tbefore")
    # a cursor token or marker text elsewhere in the file stays text; the region's first cursor is the cursor
    odd = RENAMED.replace("print(mean", "print('<|cursor|>', mean")
    q = parse_prompt(continue_prompt(odd, CURSOR, REGION, []))
    assert q.text == odd and q.cursor == odd.index("for v in") and q.diffs == ""
    stray = "<|/code_to_edit|>\n" + RENAMED  # a marker line above the pair is text too
    assert parse_prompt(continue_prompt(stray, (3, 4), (3, 8), [])).text == stray
    # the region at the file's end, no snippets, an empty history in Inception's documented form
    lines = RENAMED.split("\n")
    last = len(lines) - 1
    r = parse_prompt(continue_prompt(RENAMED, (last, 0), (last - 2, last), [], snippets=[]))
    assert r.end == len(RENAMED) and r.cursor == len(RENAMED) and r.diffs == ""


def test_unified_diffs_become_the_recent_edits_placed_in_the_document():
    text = "a = 1\nb = 2\nc = 3\nd = 4\ne = 5\n\nf = 6\ng = 7\nh = 8\ni = 9\nj = 10\n"
    diffs = "\n".join(
        [
            "--- x.py\tbefore",  # file headers and junk are read past
            "+++ x.py\tafter",
            "garbage",
            "@@ -1,3 +1,3 @@",
            " a = 1",
            "-b = 0",
            "+b = 2",
            " c = 3",
            "@@ -5,5 +5,5 @@",  # two runs in one hunk; an empty context line with its space stripped
            " e = 5",
            "",
            "-f = 0",
            "+f = 6",
            " g = 7",
            "-h = 0",
            "+h = 8",
            "\\ No newline at end of file",
            "@@ -11 +11 @@",  # difflib's header for one line
            "-j = 9",
            "+j = 10",
            "",
        ]
    )
    assert [len(h.lines) for h in hunks(diffs)] == [4, 7, 2]
    edits = recent_edits(diffs, text, cursor=0, n=3)
    assert [(e.old_text, e.new_text) for e in edits] == [("0", "6"), ("0", "8"), ("9", "10")]
    assert [(e.before, e.after) for e in edits] == [("f = ", ""), ("h = ", ""), ("j = ", "")]
    assert [text[e.start : e.start + len(e.new_text)] for e in edits] == ["6", "8", "10"]
    assert len(recent_edits(diffs, text, 0, 10)) == 4 and recent_edits("", text, 0, 3) == []
    # a hunk whose text stands twice, away from its header's line: the occurrence nearest the cursor
    twice = "x = 1\n" + "pad\n" * 20 + "y = 2\nz = 3\n" + "pad\n" * 20 + "y = 2\nz = 3\n"
    moved = "@@ -1,2 +1,2 @@\n-y = 0\n+y = 2\n z = 3\n"
    near_end = recent_edits(moved, twice, len(twice) - 1, 1)[0]
    near_top = recent_edits(moved, twice, 30, 1)[0]
    assert near_end.start == twice.rindex("y = 2") + 4 and near_top.start == twice.index("y = 2") + 4
    # a cut-short hunk keeps what it read; a diff of nothing readable gives nothing
    assert [(e.old_text, e.new_text) for e in recent_edits("@@ -1,3 +1,3 @@\n-b = 0\n+b = 2\nnope", text, 0, 3)] == [
        ("0", "2")
    ]
    assert recent_edits("@@ nonsense @@\n+x\n", text, 0, 3) == []


def test_the_body_takes_continues_fields_and_refuses_bad_ones():
    prompt = continue_prompt(RENAMED, CURSOR, REGION, HISTORY)
    p = parse_body(json.dumps(continue_body(prompt, deadline_ms=500)).encode(), Limits(), 2000)
    assert (p.prompt, p.stream, p.model, p.deadline_ms, p.max_tokens) == (prompt, True, "dlm-test", 500, 4096)
    alone = parse_body(json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), Limits(), 2000)
    assert (alone.prompt, alone.stream, alone.deadline_ms) == ("x", False, 2000)
    for bad, param in [
        ({"messages": "x"}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 9}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "model": 3}, "model"),
    ]:
        with pytest.raises(ApiError) as e:
            parse_body(json.dumps(bad).encode(), Limits(), 2000)
        assert (e.value.status, e.value.param) == (400, param), bad


# ----------------------------------------------------------------------------- over real sockets


def test_continues_request_is_answered_with_the_rename_propagated():
    """Exactly Continue's request (system + user message, every marker, a rename in the history,
    stream true): the streamed message, cut out Continue's way, is the region with the rename carried
    through it; stream false gives the same as one chat.completion object."""
    with Running("scripted:rewrite=total>acc", next_edit_approach=ENGINE) as s:
        assert httpx.get(s.url + "/v1/models").json()["data"][0]["dlm"]["next_edit"] is True
        body = continue_body(continue_prompt(RENAMED, CURSOR, REGION, HISTORY))
        expected = region_of(RENAMED, REGION).replace("total", "acc")
        assert expected != region_of(RENAMED, REGION)
        text, chunks = stream_content(s.url, body)
        assert extract(text) == expected
        assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
        done = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] == "stop"]
        assert done and done[0]["dlm"]["silent"] is None and done[0]["dlm"]["edits"] == 2
        job = s.engine.jobs[-1]
        assert isinstance(job, EditJob) and job.window == region_of(RENAMED, REGION) + "\n"
        assert RENAMED == job.prefix + job.window + job.suffix and job.deadline is not None
        assert job.edits[-1] == ("    total = 0", "    acc = 0")  # the rename's line, as the server's history holds it
        assert job.approach == "surprise+memory"

        r = post(s.url, continue_body(continue_prompt(RENAMED, CURSOR, REGION, HISTORY), stream=False), path=PATH)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["object"] == "chat.completion" and answer["model"] == "dlm-test"
        choice = answer["choices"][0]
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "stop"
        assert extract(choice["message"]["content"]) == expected
        assert {"prompt_tokens", "completion_tokens", "total_tokens"} <= set(answer["usage"])
        # a user message alone (Inception's newer docs) is answered the same
        alone = {"messages": [body["messages"][1]], "stream": False}
        assert extract(post(s.url, alone, path=PATH).json()["choices"][0]["message"]["content"]) == expected


def test_nothing_worth_proposing_answers_the_region_unchanged():
    prompt = continue_prompt(RENAMED, CURSOR, REGION, HISTORY)
    region = region_of(RENAMED, REGION)
    with Running("scripted:steps=1", next_edit_approach=ENGINE) as s:  # the engine gives the window back as it was
        text, chunks = stream_content(s.url, continue_body(prompt))
        assert extract(text) == region and chunks[-1]["dlm"]["silent"] == "unchanged"
        jobs = len(s.engine.jobs)
        # no history: nothing to go on, and no engine job
        r = post(s.url, continue_body(continue_prompt(RENAMED, CURSOR, REGION, []), stream=False), path=PATH)
        assert extract(r.json()["choices"][0]["message"]["content"]) == region
        assert r.json()["dlm"]["silent"] == "no recent edits" and len(s.engine.jobs) == jobs
    with Running("scripted:rewrite=total>acc,confidence=0.4", next_edit_approach=ENGINE) as s:  # below the gate: unsure
        r = post(s.url, continue_body(prompt, stream=False, min_confidence=0.9), path=PATH)
        assert extract(r.json()["choices"][0]["message"]["content"]) == region
        assert r.json()["dlm"]["silent"] == "unsure"
        shown = post(s.url, continue_body(prompt, stream=False), path=PATH).json()  # the server's gate: 0
        assert extract(shown["choices"][0]["message"]["content"]) == region.replace("total", "acc")
    with Running(
        "scripted:rewrite=acc>total", next_edit_approach=ENGINE
    ) as s:  # taking the user's rename back: a reversal
        window_with_edit = (1, 6)
        cursor = (1, 4)
        r = post(
            s.url, continue_body(continue_prompt(RENAMED, cursor, window_with_edit, HISTORY), stream=False), path=PATH
        )
        assert extract(r.json()["choices"][0]["message"]["content"]) == region_of(RENAMED, window_with_edit)
        assert r.json()["dlm"]["silent"] == "reversal"


def test_malformed_prompts_are_400s_and_the_server_keeps_serving():
    good = continue_prompt(RENAMED, CURSOR, REGION, HISTORY)
    lines = RENAMED.split("\n")
    no_markers = good.replace("<|code_to_edit|>\n", "").replace("<|/code_to_edit|>\n", "")
    reversed_markers = good.replace("<|code_to_edit|>", "<|TMP|>").replace("<|/code_to_edit|>", "<|code_to_edit|>")
    reversed_markers = reversed_markers.replace("<|TMP|>", "<|/code_to_edit|>")
    outside = continue_prompt(RENAMED, (0, 0), REGION, HISTORY)
    huge_lines = [*lines[:2], *(["    x = 1  # " + "y" * 80] * (MAX_REGION_CHARS // 80)), *lines[2:]]
    huge = continue_prompt("\n".join(huge_lines), CURSOR, (2, len(huge_lines) - 3), HISTORY)
    user = continue_body(good)["messages"][1]
    cases = [
        ({"messages": [{"role": "user", "content": no_markers}]}, "no <|code_to_edit|> and <|/code_to_edit|> lines"),
        ({"messages": [{"role": "user", "content": good.replace("<|cursor|>", "")}]}, "<|cursor|> token is missing"),
        ({"messages": [{"role": "user", "content": reversed_markers}]}, "markers are reversed"),
        (
            {"messages": [{"role": "user", "content": good.replace("<|code_to_edit|>\n", "")}]},
            "no <|code_to_edit|> line",
        ),
        ({"messages": [{"role": "user", "content": outside}]}, "outside the editable region"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": good}]}]}, "content must be a string"),
        ({"messages": [{"role": "system", "content": SYSTEM}]}, "no message with role 'user'"),
        ({"prompt": good}, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "user", "content": "fix this"}]}, "no <|current_file_content|> block"),
        ({"messages": [{"role": "user", "content": good.split("<|edit_diff_history|>")[0]}]}, "<|edit_diff_history|>"),
        ({"messages": [{"role": "user", "content": huge}]}, "mark fewer lines"),
        ({"messages": [user], "stream": "yes"}, "'stream' must be true or false"),
        ({"messages": [user], "temperature": -1}, "'temperature' must be"),
    ]
    with Running("scripted:rewrite=total>acc", limits=Limits(max_body_bytes=64 * 1024), next_edit_approach=ENGINE) as s:
        for body, message in cases:
            r = post(s.url, body, path=PATH)
            assert r.status_code == 400, (message, r.status_code, r.text)
            assert message in r.json()["error"]["message"], (message, r.text)
        assert post(s.url, b"{not json", path=PATH).status_code == 400
        big = post(s.url, continue_body(good + "#" * (80 * 1024)), path=PATH)
        assert big.status_code == 413 and "65536" in big.json()["error"]["message"]
        other = post(s.url, continue_body(good, model="mercury-coder"), path=PATH)
        assert other.status_code == 404 and "dlm-test" in other.json()["error"]["message"]
        assert s.engine.jobs == [] and s.server.counters["errors"] == 0 and s.server.inflight == 0
        text, _ = stream_content(s.url, continue_body(good))
        assert extract(text) == region_of(RENAMED, REGION).replace("total", "acc")
    with Running(
        "scripted:rewrite=total>acc", tokenizer=CharTokenizer(), next_edit_approach=ENGINE
    ) as s:  # the region past the slots
        r = post(s.url, continue_body(good, max_tokens=40), path=PATH)
        assert r.status_code == 400 and "tokens; at most 40 are rewritten" in r.json()["error"]["message"], r.text
        assert s.engine.jobs == [] and post(s.url, continue_body(good), path=PATH).status_code == 200


def test_a_client_that_disconnects_cancels_the_edit_job(tmp_path: Path):
    with Running(
        f"scripted:rewrite=total>acc,hold={urllib.parse.quote(str(tmp_path))}", next_edit_approach=ENGINE
    ) as s:
        body = json.dumps(continue_body(continue_prompt(RENAMED, CURSOR, REGION, HISTORY), deadline_ms=30000)).encode()
        c = socket.create_connection(("127.0.0.1", s.port))
        c.sendall(
            b"POST /v1/edit/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        wait_for(lambda: (tmp_path / "started-1").exists(), "the edit job to start")
        c.close()
        job = s.engine.jobs[0]
        wait_for(lambda: job.cancelled, "the engine job to be cancelled after its client left")
        wait_for(lambda: s.server.counters["disconnected"] == 1, "the disconnect to be counted")
        (tmp_path / "release").write_text("")  # later jobs run through
        r = post(s.url, continue_body(continue_prompt(RENAMED, CURSOR, REGION, HISTORY), stream=False), path=PATH)
        assert r.status_code == 200 and s.server.inflight == 0


def test_the_http_command_takes_the_servers_next_edit_options(monkeypatch):
    """--next-edit-approach and --next-edit-min-confidence reach the server as the language server's
    nextEditApproach and nextEditMinConfidence; a value out of range is refused before anything loads."""
    import argparse

    from dlm_lsp.http import app

    made: dict = {}

    class Built(Exception):
        pass

    def server(*_a, **kw):
        made.update(kw)
        raise Built

    monkeypatch.setattr(app, "FimServer", server)
    monkeypatch.setattr(app, "engine_factory", lambda *a: None)
    monkeypatch.setattr(app, "load_tokenizer", lambda *a: None)
    p = argparse.ArgumentParser()
    app.add_http_args(p)
    defaults = p.parse_args([])
    assert (defaults.next_edit_approach, defaults.next_edit_min_confidence) == ("propagate", None)
    with pytest.raises(Built):
        app.run_http(p.parse_args(["--next-edit-approach", "window", "--next-edit-min-confidence", "0.25"]))
    assert made["next_edit_approach"] == "window" and made["next_edit_min_confidence"] == 0.25
    assert app.run_http(p.parse_args(["--next-edit-min-confidence", "1.5"])) == 2
    with pytest.raises(SystemExit):
        p.parse_args(["--next-edit-approach", "guess"])
