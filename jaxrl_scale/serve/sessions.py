"""Agent sessions: an episode's OpenAI calls through a URL of its own, kept as token ids.

    sessions = Sessions()
    app = make_app(backend, tokenizer, sessions=sessions)
    sid, secret = sessions.open()           # base_url .../sessions/<sid>/v1, api_key secret
    ...                                     # the agent calls it, any number of times
    session = sessions.close(sid)           # later calls: an error; session.branches: samples

Token in, token out. A session keeps, per branch, the exact ids the engine consumed and
sampled: each call's prompt part (mask 0) and its sampled reply (mask 1, with log-probs),
end-of-turn token included. A call continues a branch when its messages are that branch's last
call's messages, then the assistant message as it was returned, then new messages (a tool
result, a user turn): only the new messages are rendered, as the chat template writes them
after an assistant turn (`tasks.env.Observations.after_turn`), and appended to the kept ids.
Earlier turns are never rendered again, so the model goes on from what it really sampled,
reasoning included, even where a template would strip it. The returned assistant message
matches its echo by role, content, tool calls (name and arguments as JSON values; the ids an
agent may rewrite are not compared) and reasoning where the echo carries it (agent frameworks
drop it). Any other call (an edited or compacted history, another system prompt, other tools)
starts a new branch, rendered whole.

A call whose reply did not reach the agent (the client went away mid-call, the session closed)
leaves its branch as it was. The OpenAI SDK retries a request that failed or timed out; a
retry (its `X-Stainless-Retry-Count` header > 0) with the body of a call already answered gets
that answer again, not a second sample.

Threads: the registry is called from the server's event loop (calls) and from the thread that
runs episodes (open, close); `_lock` guards the registry and each session's state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import itertools
import json
import secrets
import threading
import uuid
from typing import Any


@dataclasses.dataclass
class Branch:
    """One training sample of a session: `ids` (prompt parts and replies), `mask` (1 where
    sampled), `logp` (sampled tokens' behaviour log-probs, 0 elsewhere), `versions` (the
    policy version of each sampled token, -1 elsewhere), `calls` ((start, reply start, end)
    of each call in `ids`)."""

    index: int
    ids: list[int]
    mask: list[int]
    logp: list[float]
    versions: list[int]
    calls: list[tuple[int, int, int]]
    history: list[dict]  # the last call's messages, then its reply, compared as `_canonical`
    reasoning: str | None  # the last reply's reasoning (compared when an echo has one)
    tools: str  # the tools offered and the template's settings, as canonical JSON
    ended_with: int | None  # the end-of-turn id the last reply ended with; None: cut off


@dataclasses.dataclass
class Session:
    id: str
    secret: str
    not_before: int | None = None  # its calls decode with a policy version at least this
    open: bool = True
    calls: int = 0
    branches: list[Branch] = dataclasses.field(default_factory=list)
    last: int = -1  # the branch of the newest call
    answered: dict[str, Any] = dataclasses.field(default_factory=dict)  # body digest -> reply
    live: set = dataclasses.field(default_factory=set)  # generations in flight


@dataclasses.dataclass(frozen=True)
class Continuation:
    """Where a call goes: `branch` None is a new branch rendered whole; else `new` are the
    messages rendered after the branch's last reply."""

    branch: Branch | None
    new: list[dict]


class SessionError(Exception):
    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.code = status, code


class Sessions:
    """The sessions of a server, by id (unique for the registry's life: a counter and a
    random part). `sampling`: (temperature, top_p) every session call samples with, whatever
    it asks (a training run's: the behaviour log-probs the loss expects); None: the call's."""

    def __init__(self, sampling: tuple[float, float] | None = None):
        self.sampling = sampling
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._ended: dict[str, Session] = {}  # closed with `keep`, until closed again
        self._count = itertools.count()

    def open(self, not_before: int | None = None) -> tuple[str, str]:
        """A new session: (its id, its secret: the api_key its calls need). `not_before`:
        its calls are decoded by a policy version at least this (a training batch's bound)."""
        sid = f"s{next(self._count)}-{uuid.uuid4().hex[:12]}"
        secret = secrets.token_urlsafe(24)
        with self._lock:
            self._sessions[sid] = Session(sid, secret, not_before)
        return sid, secret

    def close(self, sid: str, keep: bool = False) -> Session:
        """End session `sid`: later calls are refused, calls in flight are cancelled (their
        replies are not kept). Returns it, branches and all; the registry forgets it, or with
        `keep` holds it until it is closed again (which returns it)."""
        with self._lock:
            session = self._sessions.pop(sid, None)
            if session is None:
                return self._ended.pop(sid)
            if keep:
                self._ended[sid] = session
            session.open = False
            live, session.live = list(session.live), set()
        for generation in live:
            generation.cancel_from_thread()
        return session

    def authorize(self, sid: str, authorization: str) -> Session:
        """The open session `sid` whose secret `authorization` ("Bearer SECRET") carries."""
        with self._lock:
            session = self._sessions.get(sid)
        scheme, _, token = authorization.partition(" ")
        if session is None:
            raise SessionError(404, f"no open session {sid!r} (it ended, or never was)",
                               "session_not_found")  # fmt: skip
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), session.secret.encode()
        ):
            raise SessionError(401, "wrong key for this session (Authorization: Bearer KEY, "
                               "the session's api_key)", "invalid_api_key")  # fmt: skip
        return session

    # ------------------------------------------------------------------ calls

    def place(self, session: Session, messages: list[dict], tools: Any) -> Continuation:
        """Where a call with `messages` (as the template reads them) and `tools` (what else
        the template renders with: its tools, its keyword settings) goes: the newest branch
        it continues, else a new one."""
        canon = [_canonical(m) for m in messages]
        offered = _tools_key(tools)
        with self._lock:
            branches = list(reversed(session.branches))
        for branch in branches:
            n = len(branch.history)
            if branch.tools != offered or len(canon) <= n or canon[:n] != branch.history:
                continue
            echo = messages[n - 1].get("reasoning_content")
            if echo and echo != branch.reasoning:  # a rewritten reasoning is an edit
                continue
            return Continuation(branch, messages[n:])
        return Continuation(None, messages)

    def record(
        self,
        session: Session,
        where: Continuation,
        *,
        prompt: list[int],
        reply: list[int],
        logp: list[float],
        versions: list[int],
        messages: list[dict],
        message: dict,
        tools: Any,
        ended_with: int | None,
        digest: str,
        answer: Any,
    ) -> Branch | None:
        """A call answered: `prompt` the ids consumed (a continuation: the whole branch's ids
        and then the new part), `reply` the sampled ids, `message` the reply as returned.
        Nothing is kept once the session is closed (returns None)."""
        with self._lock:
            if not session.open:
                return None
            branch = where.branch
            if branch is not None and prompt[: len(branch.ids)] != branch.ids:
                # Two calls continued the branch at once and the other was answered first:
                # this one becomes a branch of its own, from the ids it consumed.
                branch = None
            if branch is None:
                branch = Branch(len(session.branches), [], [], [], [], [], [], None, "", None)
                session.branches.append(branch)
            session.calls += 1
            if answer is not None:
                session.answered[digest] = answer
            start = len(branch.ids)
            fresh = prompt[start:]
            branch.ids += fresh + reply
            branch.mask += [0] * len(fresh) + [1] * len(reply)
            branch.logp += [0.0] * len(fresh) + list(logp)
            branch.versions += [-1] * len(fresh) + list(versions)
            branch.calls.append((start, start + len(fresh), len(branch.ids)))
            branch.history = [_canonical(m) for m in messages] + [_canonical(message)]
            branch.reasoning = message.get("reasoning_content")
            branch.tools = _tools_key(tools)
            branch.ended_with = ended_with
            session.last = branch.index
            return branch

    def answered(self, session: Session, digest: str) -> Any:
        with self._lock:
            return session.answered.get(digest)

    def started(self, session: Session, generation) -> bool:
        """`generation` is in flight for `session`; False when the session has closed."""
        with self._lock:
            if session.open:
                session.live.add(generation)
            return session.open

    def ended(self, session: Session, generation) -> None:
        with self._lock:
            session.live.discard(generation)


def digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _canonical(m: dict) -> dict:
    """A message as compared: role, content text, tool calls as (name, arguments as JSON
    values), a tool result's call id and name; not the calls' ids nor the reasoning."""
    out: dict[str, Any] = {"role": m.get("role"), "content": m.get("content") or ""}
    calls = m.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            (c["function"]["name"], _json_value(c["function"].get("arguments"))) for c in calls
        ]
    for key in ("tool_call_id", "name"):
        if m.get(key):
            out[key] = m[key]
    return out


def _json_value(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _tools_key(tools: Any) -> str:
    return json.dumps(tools or [], sort_keys=True)
