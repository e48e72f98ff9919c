// The calc agent in Node.js: the Python calc agent (examples/calc/agent.py) rewritten on the openai npm package,
// with streamed chat completions and one tool, a calculator. lit trains the model behind it as a program:
//
//   echo '{"id": "t1", "question": "...", "answer": 11}' | OPENAI_BASE_URL=... LIT_MODEL=... node agent.mjs
//
// The task comes as one JSON line on stdin; the reward goes out as the last line of stdout, {"reward": 1} when the
// final answer equals task.answer, else {"reward": 0}. The LLM endpoint comes from the environment lit sets
// (OPENAI_BASE_URL and OPENAI_API_KEY, which the openai client reads by itself; LIT_MODEL, LIT_TEMPERATURE,
// LIT_MAX_TOKENS), and every call to it is recorded by the trainer: nothing here knows of lit.
//
// The prompt is the Python agent's, byte for byte (tests/sdk/test_command_agent.py compares the requests): the
// 135M model learns from these worked examples, so keep them in step with SHOTS in examples/calc/agent.py. One LLM
// call: a calculator call's result is the answer; a text reply's last number is. A failed tool call or a reply
// without a number scores 0. An error of the endpoint (refused connection, HTTP error) ends the program with an
// error, so the trainer retries the rollout.

import OpenAI from "openai";

const SYSTEM_MESSAGE = "Solve the problem with the calculator tool.";
const SHOTS = [
  ["Ana has 20 coins, gets 15 more, then spends 8. How many coins does Ana have?", "20+15-8"],
  ["Ben buys 4 boxes of 13 pens and already had 9. How many pens does Ben have?", "4*13+9"],
  ["Kim has 5 jars with 16 beads each and drops 7. How many beads are left?", "5*16-7"],
  ["Leo puts 28 red and 14 blue caps equally into 6 cups. How many caps are in each cup?", "(28+14)/6"],
  ["Tom has 3 bags with 12 apples each. How many apples does Tom have?", "3*12"],
  ["Sam shares 84 shells equally among 7 friends. How many shells does each friend get?", "84/7"],
  ["Mia has 27 red and 18 blue pens and puts them equally into 5 cups. How many pens are in each cup?", "(27+18)/5"],
];
const CALCULATOR = {
  type: "function",
  function: {
    name: "calculator",
    description: "Evaluate an arithmetic expression, e.g. 3*12+5.",
    parameters: { type: "object", properties: { expression: { type: "string" } }, required: ["expression"] },
    strict: false,
  },
};
const MAX_EXPRESSION_CHARS = 64;
const NUMBER = /-?\d+(?:\.\d+)?/g;

// The question as the model sees it: its numbers listed on a line of their own after it.
function withNumbers(question) {
  return `${question}\nNumbers: ${(question.match(NUMBER) ?? []).join(", ")}`;
}

// A calculator call exactly as lit's chat template renders an assistant's tool call (Python's json.dumps spacing).
function toolCallText(expression) {
  return `<tool_call>\n{"name": "calculator", "arguments": {"expression": ${JSON.stringify(expression)}}}\n</tool_call>`;
}

// The last number in text (the final answer), or null.
function finalNumber(text) {
  const numbers = text.match(NUMBER);
  return numbers ? Number(numbers[numbers.length - 1]) : null;
}

// The value of an expression of numbers, + - * / and parentheses (× ÷ x too); anything else throws. A parser of
// its own: no eval.
function evaluate(expression) {
  if (expression.length > MAX_EXPRESSION_CHARS) throw new Error(`expression longer than ${MAX_EXPRESSION_CHARS}`);
  const tokens = expression.replace(/×|x/g, "*").replace(/÷/g, "/").match(/\d+(?:\.\d*)?|\.\d+|\S/g) ?? [];
  let at = 0;
  const peek = () => tokens[at];
  const take = () => tokens[at++];
  function sum() {
    let value = product();
    while (peek() === "+" || peek() === "-") value = take() === "+" ? value + product() : value - product();
    return value;
  }
  function product() {
    let value = unary();
    while (peek() === "*" || peek() === "/") {
      if (take() === "*") value *= unary();
      else {
        const divisor = unary();
        if (divisor === 0) throw new Error("division by zero");
        value /= divisor;
      }
    }
    return value;
  }
  function unary() {
    if (peek() === "+" || peek() === "-") return take() === "-" ? -unary() : unary();
    if (peek() === "(") {
      take();
      const value = sum();
      if (take() !== ")") throw new Error("unbalanced parentheses");
      return value;
    }
    const token = take();
    if (token === undefined || !/^[\d.]/.test(token)) throw new Error(`not an arithmetic expression: ${expression}`);
    return Number(token);
  }
  const value = sum();
  if (at !== tokens.length) throw new Error(`only numbers, + - * / and parentheses are allowed: ${expression}`);
  return value;
}

function calculator(expression) {
  const result = evaluate(expression);
  return Number.isInteger(result) ? String(result) : String(Number(result.toPrecision(6)));
}

// The answer a calculator call gives: the last number of its results, or null when a call fails.
function toolAnswer(calls) {
  const results = [];
  for (const call of calls) {
    try {
      if (call.name !== "calculator") throw new Error(`unknown tool ${call.name}`);
      results.push(calculator(String(JSON.parse(call.arguments).expression)));
    } catch {
      return null; // a failed call's error text is no answer
    }
  }
  return finalNumber(results.join("\n"));
}

async function readTask() {
  let text = "";
  for await (const chunk of process.stdin) text += chunk;
  return JSON.parse(text);
}

// One streamed chat completion: the reply's text and its tool calls, put together from the chunks.
async function complete(client, task) {
  const messages = [{ role: "system", content: SYSTEM_MESSAGE }];
  for (const [question, expression] of SHOTS) {
    messages.push({ role: "user", name: "user", content: withNumbers(question) });
    messages.push({ role: "assistant", content: toolCallText(expression) });
  }
  messages.push({ role: "user", name: "user", content: withNumbers(task.question) });
  const stream = await client.chat.completions.create({
    model: process.env.LIT_MODEL,
    messages,
    max_tokens: Number(process.env.LIT_MAX_TOKENS ?? 48),
    temperature: Number(process.env.LIT_TEMPERATURE ?? 0.7),
    tool_choice: "auto",
    tools: [CALCULATOR],
    stream: true,
  });
  let text = "";
  const calls = [];
  for await (const chunk of stream) {
    const delta = chunk.choices[0]?.delta;
    if (!delta) continue; // the usage chunk
    text += delta.content ?? "";
    for (const part of delta.tool_calls ?? []) {
      const call = (calls[part.index] ??= { name: "", arguments: "" });
      call.name += part.function?.name ?? "";
      call.arguments += part.function?.arguments ?? "";
    }
  }
  return { text, calls: calls.filter(Boolean) };
}

try {
  const task = await readTask();
  const client = new OpenAI(); // OPENAI_BASE_URL and OPENAI_API_KEY: the rollout's endpoint, set by lit
  const { text, calls } = await complete(client, task);
  const answer = calls.length ? toolAnswer(calls) : finalNumber(text);
  console.log(JSON.stringify({ reward: answer !== null && answer === task.answer ? 1 : 0 }));
} catch (error) {
  // The rollout fails (the trainer retries it) with the reason as the last line of stderr, which lit quotes.
  console.error(error);
  const reasons = [];
  for (let e = error; e && reasons.length < 5; e = e.cause) reasons.push(e.message ?? String(e));
  console.error(`agent.mjs: ${reasons.join(": ")}`);
  process.exit(1);
}
