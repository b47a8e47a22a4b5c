"""The client side of tools/container_check.sh: the official ``openai`` client against a server in a container.

    python tools/container_check_client.py URL MODEL                  # completion, stream, chat
    python tools/container_check_client.py URL MODEL --drain CMD...   # a long stream, CMD (docker stop) run mid-stream

Exits 1 with one line on stderr at the first thing that is not as it should be. ``--drain`` starts a stream, runs CMD
once the first tokens arrived and reads on: the stream must still end properly (a finish reason, then the end of the
events), and tokens must have come after CMD started. Its last line, ``last-event-ns N``, is when the stream's last
event arrived (time.time_ns), for the caller to check that it came after the server got its signal.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import openai

PROMPT = "def fibonacci(n):"
# with drafting off, long enough that a stream is still running when docker stop's SIGTERM reaches the server
DRAIN_TOKENS = 1500


class CheckFailed(Exception):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def completion(client: openai.OpenAI, model: str) -> str:
    answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    text, reason = answer.choices[0].text, answer.choices[0].finish_reason
    check(bool(text) and reason in ("length", "stop"), f"completion: text {text!r}, finish_reason {reason!r}")
    print(f"completion ok: {text!r}")
    return text


def stream(client: openai.OpenAI, model: str, expected: str) -> None:
    """The same greedy request streamed must give the same text, in more than one event."""
    events = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True))
    text = "".join(event.choices[0].text for event in events if event.choices)
    reasons = [event.choices[0].finish_reason for event in events if event.choices and event.choices[0].finish_reason]
    check(len(events) > 1 and reasons in (["length"], ["stop"]), f"stream: {len(events)} events, finish reasons {reasons}")
    check(text == expected, f"stream: text {text!r} differs from the completion's {expected!r}")
    print(f"stream ok: {len(events)} events")


def chat(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Write a function that reverses a list."}]
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    message, reason = answer.choices[0].message, answer.choices[0].finish_reason
    check(message.role == "assistant" and bool(message.content), f"chat: message {message!r}")
    check(reason in ("length", "stop"), f"chat: finish_reason {reason!r}")
    print(f"chat ok: {message.content!r}")


def drain(client: openai.OpenAI, model: str, command: list[str]) -> None:
    # drafting off: the tiny model's drafted stream can end before `docker stop` has the daemon send SIGTERM; one token
    # a step keeps it in flight for seconds
    events = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=DRAIN_TOKENS, temperature=0, stream=True, extra_body={"draft": "none"}
    )
    stopper, after, reason, last = None, 0, None, 0
    for event in events:
        if not event.choices:
            continue
        if stopper is None:
            stopper = subprocess.Popen(command)  # the first tokens are here: the request is in flight
            started = time.monotonic()
        elif event.choices[0].text:
            after += 1
        reason = event.choices[0].finish_reason or reason
        last = time.time_ns()
    check(stopper is not None, "drain: the stream ended before its first token")
    seconds = time.monotonic() - started
    check(stopper.wait(timeout=600) == 0, f"drain: {' '.join(command)} failed")
    check(reason in ("length", "stop"), f"drain: the stream ended without a finish reason (got {reason!r})")
    check(after > 0, "drain: no token came after the stop began: the stream was not in flight")
    print(f"drain ok: {after} more events over {seconds:.1f} s after `{' '.join(command)}` began, finish_reason {reason}")
    # for the caller to compare with the time the signal was sent (docker events)
    print(f"last-event-ns {last}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("model")
    parser.add_argument("--no-chat", action="store_true", help="skip the chat request")
    parser.add_argument("--drain", nargs=argparse.REMAINDER, help="only the drain check, running this command mid-stream")
    args = parser.parse_args(argv)
    # no key is set on the server; the client wants one all the same. No retries: a failure is the finding.
    client = openai.OpenAI(base_url=args.url, api_key="unused", max_retries=0, timeout=300)
    try:
        if args.drain:
            drain(client, args.model, args.drain)
            return 0
        text = completion(client, args.model)
        stream(client, args.model, text)
        if not args.no_chat:
            chat(client, args.model)
    except (CheckFailed, openai.OpenAIError) as exc:
        print(f"error: {exc}".splitlines()[0], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
