// An agent process in Node.js without lit: two LLM calls with fetch, through the API and mode on its command line
// (chat|completions|responses|messages, plain|stream), the task on stdin, the endpoint from the environment the
// worker sets, its reward as the last line of stdout. Streams are read as server-sent events.
import { createInterface } from "node:readline";

const [api, mode] = process.argv.slice(2);
const stream = mode === "stream";
const env = process.env;
const sampling = { temperature: Number(env.LIT_TEMPERATURE) };
const maxTokens = Number(env.LIT_MAX_TOKENS);

async function post(url, headers, body) {
  const response = await fetch(url, {
    method: "POST",
    headers: { "content-type": "application/json", "x-lit-agent": "solver", ...headers },
    body: JSON.stringify({ model: env.LIT_MODEL, ...sampling, ...body, ...(stream ? { stream: true } : {}) }),
  });
  if (!response.ok) throw new Error(`${url}: ${response.status} ${await response.text()}`);
  if (!stream) return [await response.json()];
  const events = [];
  for (const block of (await response.text()).split("\n\n")) {
    const data = block.split("\n").find((line) => line.startsWith("data:"));
    if (data && data.slice(5).trim() !== "[DONE]") events.push(JSON.parse(data.slice(5)));
  }
  return events;
}

const openai = (route, body) => post(`${env.OPENAI_BASE_URL}/${route}`, { authorization: `Bearer ${env.OPENAI_API_KEY}` }, body);
const anthropic = (body) => post(`${env.ANTHROPIC_BASE_URL}/v1/messages`, { "x-api-key": env.ANTHROPIC_API_KEY, "anthropic-version": "2023-06-01" }, body);

function chatText(events) {
  return events.map((e) => (stream ? e.choices?.[0]?.delta?.content : e.choices[0].message.content) ?? "").join("");
}

async function main() {
  const task = JSON.parse((await createInterface({ input: process.stdin })[Symbol.asyncIterator]().next()).value);
  const q = task.question;
  if (api === "chat") {
    const first = chatText(await openai("chat/completions", { messages: [{ role: "user", content: q }], max_tokens: maxTokens }));
    await openai("chat/completions", { messages: [{ role: "user", content: q }, { role: "assistant", content: first }, { role: "user", content: "Again, shorter." }], max_tokens: maxTokens });
  } else if (api === "completions") {
    const first = (await openai("completions", { prompt: q, max_tokens: maxTokens })).map((e) => e.choices?.[0]?.text ?? "").join("");
    await openai("completions", { prompt: `${q}${first}\nAgain:`, max_tokens: maxTokens });
  } else if (api === "responses") {
    const events = await openai("responses", { input: q, max_output_tokens: maxTokens });
    const first = stream ? events.at(-1).response : events[0]; // completed, or incomplete at max tokens
    await openai("responses", { input: "Again, shorter.", previous_response_id: first.id, max_output_tokens: maxTokens });
  } else {
    const events = await anthropic({ messages: [{ role: "user", content: q }], max_tokens: maxTokens });
    const text = stream
      ? events.filter((e) => e.type === "content_block_delta").map((e) => e.delta.text ?? "").join("")
      : events[0].content.filter((b) => b.type === "text").map((b) => b.text).join("");
    await anthropic({ messages: [{ role: "user", content: q }, { role: "assistant", content: text || "?" }, { role: "user", content: "Again, shorter." }], max_tokens: maxTokens });
  }
  console.log(JSON.stringify({ reward: 1.0 }));
}

main().catch((err) => { console.error(err.stack ?? String(err)); process.exit(1); });
