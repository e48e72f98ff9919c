"""An agent process without lit, as a user writes one with the official clients: two LLM calls through the API and
mode given on its command line (chat|completions|responses|messages, plain|stream), the task on stdin, the
endpoint from the environment the worker sets, its reward as the last line of stdout."""

import json
import os
import sys

import anthropic
import openai

API, MODE = sys.argv[1], sys.argv[2]
STREAM = MODE == "stream"
MODEL, HEADERS = os.environ["LIT_MODEL"], {"X-Lit-Agent": "solver"}
TEMPERATURE, MAX_TOKENS = float(os.environ["LIT_TEMPERATURE"]), int(os.environ["LIT_MAX_TOKENS"])


def chat(client: openai.OpenAI, messages: list) -> str:
    kwargs = dict(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=TEMPERATURE,
                  extra_headers=HEADERS)
    if not STREAM:
        return client.chat.completions.create(**kwargs).choices[0].message.content or ""
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                   if c.choices)


def completion(client: openai.OpenAI, prompt: str) -> str:
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=TEMPERATURE, extra_headers=HEADERS)
    if not STREAM:
        return client.completions.create(**kwargs).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)


def response(client: openai.OpenAI, text: str, previous: str | None) -> tuple[str, str]:
    kwargs = dict(model=MODEL, input=text, max_output_tokens=MAX_TOKENS, temperature=TEMPERATURE,
                  extra_headers=HEADERS, **({"previous_response_id": previous} if previous else {}))
    if not STREAM:
        answer = client.responses.create(**kwargs)
        return answer.output_text, answer.id
    last = list(client.responses.create(stream=True, **kwargs))[-1].response  # completed, or incomplete (max tokens)
    return last.output_text, last.id


def message(client: anthropic.Anthropic, messages: list) -> str:
    kwargs = dict(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, extra_body={"temperature": TEMPERATURE},
                  extra_headers=HEADERS)  # this client's create() has no temperature of its own
    if not STREAM:
        answer = client.messages.create(**kwargs)
    else:
        with client.messages.stream(**kwargs) as stream:
            answer = stream.get_final_message()
    return "".join(block.text for block in answer.content if block.type == "text")


def main() -> None:
    question = json.loads(sys.stdin.readline())["question"]
    if API == "messages":
        client = anthropic.Anthropic()
        first = message(client, [{"role": "user", "content": question}])
        message(client, [{"role": "user", "content": question}, {"role": "assistant", "content": first or "?"},
                         {"role": "user", "content": "Again, shorter."}])
    elif API == "responses":
        first, previous = response(openai.OpenAI(), question, None)
        response(openai.OpenAI(), "Again, shorter.", previous)
    elif API == "completions":
        first = completion(openai.OpenAI(), question)
        completion(openai.OpenAI(), question + first + "\nAgain:")
    else:
        first = chat(openai.OpenAI(), [{"role": "user", "content": question}])
        chat(openai.OpenAI(), [{"role": "user", "content": question}, {"role": "assistant", "content": first},
                               {"role": "user", "content": "Again, shorter."}])
    print(json.dumps({"reward": 1.0}))


if __name__ == "__main__":
    main()
