"""Agent sessions on the OpenAI server (serve/sessions.py): calls through a session's URL kept
as the exact token ids the engine consumed and sampled, continued without re-rendering,
branched when the history is not the one returned; secrets, ended sessions and SDK retries."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import openai
import pytest
from test_serve import KEY, TOOLS, WAIT_S, Scripted, Server, qwen3_tokenizer

from jaxrl_scale.serve.app import make_app
from jaxrl_scale.serve.sessions import Sessions


@pytest.fixture(scope="module")
def tokenizer():
    return qwen3_tokenizer()


@pytest.fixture(scope="module")
def served(tokenizer):
    backend = Scripted(tokenizer)
    sessions = Sessions()
    server = Server(make_app(backend, tokenizer, api_key=KEY, sessions=sessions), backend)
    server.sessions = sessions
    yield server
    server.close()
    backend.close()


def post(url: str, body: dict, headers: dict) -> dict:
    headers = {"Content-Type": "application/json", **headers}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    with urllib.request.urlopen(request, timeout=WAIT_S) as r:
        return json.loads(r.read())


def client(server, sid: str, secret: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/sessions/{sid}/v1", api_key=secret,
                         max_retries=0, timeout=WAIT_S, **kw)  # fmt: skip


def ask(c: openai.OpenAI, messages, **kw):
    return c.chat.completions.create(
        model="scripted", messages=messages, extra_body={"return_token_ids": True}, **kw
    )


def echo(message) -> dict:
    """The reply as an agent puts it back into its history (the SDK's own object)."""
    return message.model_dump(exclude_none=True)


def test_a_tool_episode_is_one_branch_of_exact_ids(served, tokenizer):
    """Call, tool result, call: the second call's prompt ids are the first call's prompt and
    sampled ids, then only the tool result as the template writes it after an assistant turn;
    the branch is those ids, sampled ones masked 1 with their log-probs."""
    sid, secret = served.sessions.open()
    c = client(served, sid, secret)
    messages = [{"role": "user", "content": "TOOL please add 1 and 2"}]
    first = ask(c, messages, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    messages += [echo(first.choices[0].message),
                 {"role": "tool", "tool_call_id": call.id, "content": "3"}]  # fmt: skip
    second = ask(c, messages, tools=TOOLS)
    p1, s1 = first.model_extra["prompt_token_ids"], first.choices[0].model_extra["token_ids"]
    p2, s2 = second.model_extra["prompt_token_ids"], second.choices[0].model_extra["token_ids"]
    assert p2[: len(p1) + len(s1)] == p1 + s1  # nothing before was rendered again
    new = tokenizer.decode(p2[len(p1) + len(s1) :], skip_special_tokens=False)
    assert new == "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n" \
        "<|im_start|>assistant\n"  # fmt: skip
    session = served.sessions.close(sid)
    assert session.calls == 2 and len(session.branches) == 1
    (branch,) = session.branches
    assert branch.ids == p2 + s2
    assert branch.mask == [0] * len(p1) + [1] * len(s1) + [0] * (len(p2) - len(p1) - len(s1)) \
        + [1] * len(s2)  # fmt: skip
    sampled = [lp for lp, m in zip(branch.logp, branch.mask, strict=True) if m]
    assert sampled == pytest.approx([-0.5] * (len(s1) + len(s2)))  # the scripted log-probs
    assert branch.calls == [(0, len(p1), len(p1) + len(s1)), (len(p1) + len(s1), len(p2),
                                                               len(p2) + len(s2))]  # fmt: skip


def test_reasoning_stays_in_the_ids_and_an_edited_history_branches(served, tokenizer):
    """The Qwen3 template drops an earlier turn's thinking when it renders a history; the
    session does not render it again, so the model's own thinking stays in its context,
    whether the agent echoes the reasoning or drops it. A history edited or compacted
    starts a new branch, rendered whole."""
    sid, secret = served.sessions.open()
    c = client(served, sid, secret)
    messages = [{"role": "user", "content": "THINK what is 2 + 2?"}]
    first = ask(c, messages)
    reply = first.choices[0].message
    assert reply.model_extra["reasoning_content"].strip() == "hmm, 2 + 2"
    dropped = {"role": "assistant", "content": reply.content}  # a framework's echo
    second = ask(c, [*messages, dropped, {"role": "user", "content": "and 3 + 3?"}])
    prompt = tokenizer.decode(second.model_extra["prompt_token_ids"], skip_special_tokens=False)
    assert "<think>\nhmm, 2 + 2\n</think>" in prompt
    rendered = tokenizer.apply_chat_template(
        [*messages, dropped, {"role": "user", "content": "and 3 + 3?"}]
    )
    assert "hmm, 2 + 2" not in rendered  # what re-rendering would have given the model
    # Edited: the first question changed. Rewritten reasoning: also an edit.
    ask(c, [{"role": "user", "content": "THINK what is 2 + 5?"}, dropped,
            {"role": "user", "content": "and 3 + 3?"}])  # fmt: skip
    rewritten = {**dropped, "reasoning_content": "I knew it"}
    ask(c, [*messages, rewritten, {"role": "user", "content": "and 3 + 3?"}])
    session = served.sessions.close(sid)
    assert session.calls == 4
    assert [len(b.calls) for b in session.branches] == [2, 1, 1]


def test_keys_ended_sessions_and_unique_ids(served):
    a, a_secret = served.sessions.open()
    b, b_secret = served.sessions.open()
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError):
        ask(client(served, a, b_secret), user)  # another session's key
    with pytest.raises(openai.AuthenticationError):
        ask(client(served, a, KEY), user)  # the server's key is not a session's
    assert [m.id for m in client(served, b, b_secret).models.list()] == ["scripted"]
    assert ask(client(served, b, b_secret), user).choices[0].finish_reason == "stop"
    served.sessions.close(a)
    with pytest.raises(openai.NotFoundError) as e:
        ask(client(served, a, a_secret), user)  # after its episode ended
    assert e.value.body["code"] == "session_not_found"
    with pytest.raises(openai.NotFoundError):
        ask(client(served, "nobody", a_secret), user)
    with pytest.raises(openai.BadRequestError):
        ask(client(served, b, b_secret), user, n=2)
    session = served.sessions.close(b)
    assert session.calls == 1 and len(session.branches) == 1  # only b's own call is in b
    ids = {served.sessions.open()[0] for _ in range(200)}
    assert len(ids) == 200 and all("/" not in i for i in ids)
    with urllib.request.urlopen(f"{served.url}/metrics", timeout=WAIT_S) as r:
        metrics = r.read().decode()
    assert 'endpoint="/sessions/{id}/v1/chat/completions",status="200"' in metrics
    assert a not in metrics  # no label per session


def test_a_retried_call_is_answered_again_not_sampled_again(served):
    """The OpenAI SDK retries a call it did not get an answer to (X-Stainless-Retry-Count);
    a retry of a call that was answered gets the same answer. The same body sent afresh is a
    new sample: a new branch."""
    sid, secret = served.sessions.open()
    url = f"{served.url}/sessions/{sid}/v1/chat/completions"
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}],
            "temperature": 1.0, "return_token_ids": True}  # fmt: skip
    auth = {"Authorization": f"Bearer {secret}"}
    first = post(url, body, {**auth, "X-Stainless-Retry-Count": "0"})
    again = post(url, body, {**auth, "X-Stainless-Retry-Count": "1"})
    assert again == first
    fresh = post(url, body, auth)
    assert fresh["id"] != first["id"]
    session = served.sessions.close(sid)
    assert session.calls == 2 and len(session.branches) == 2


def test_a_call_in_flight_when_its_session_ends_is_refused_and_not_kept(served):
    backend = served.backend
    sid, secret = served.sessions.open()
    backend.release.clear()  # HOLD replies wait for it
    got = {}

    def call():
        try:
            ask(client(served, sid, secret), [{"role": "user", "content": "HOLD on"}])
        except openai.APIError as e:
            got["error"] = e

    thread = threading.Thread(target=call)
    thread.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while not backend.stats()["slots_busy"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        session = served.sessions.close(sid)
    finally:
        backend.release.set()
    thread.join(WAIT_S)
    assert isinstance(got.get("error"), openai.NotFoundError), got
    assert session.calls == 0 and session.branches == []
    assert json.loads(json.dumps(backend.stats()))  # the server goes on


def test_two_calls_continuing_a_branch_at_once_are_both_kept(served):
    """An agent that fans out two calls from one history: both are answered; the first
    answered extends the branch, the other becomes a branch of its own (the branch it began
    from had grown)."""
    backend = served.backend
    sid, secret = served.sessions.open()
    c = client(served, sid, secret)
    messages = [{"role": "user", "content": "hi"}]
    first = ask(c, messages)
    again = [*messages, echo(first.choices[0].message), {"role": "user", "content": "HOLD on"}]
    backend.release.clear()
    got, errors = [], []

    def call():
        try:
            got.append(ask(c, again))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + WAIT_S
        while backend.stats()["slots_busy"] < 2:  # both placed on branch 0, both decoding
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        backend.release.set()
    for t in threads:
        t.join(WAIT_S)
    assert not errors and len(got) == 2
    session = served.sessions.close(sid)
    assert session.calls == 3 and [len(b.calls) for b in session.branches] == [2, 1]


def test_other_template_settings_start_a_branch(served):
    """A history continued with other template settings (Qwen3's enable_thinking) is not
    the history the kept ids were rendered with: a new branch, rendered whole."""
    sid, secret = served.sessions.open()
    c = client(served, sid, secret)
    messages = [{"role": "user", "content": "hi"}]
    first = ask(c, messages)
    more = [*messages, echo(first.choices[0].message), {"role": "user", "content": "and?"}]
    second = ask(c, more)  # continues
    again = [*more, echo(second.choices[0].message), {"role": "user", "content": "more?"}]
    c.chat.completions.create(
        model="scripted",
        messages=again,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    session = served.sessions.close(sid)
    assert [len(b.calls) for b in session.branches] == [2, 1]
