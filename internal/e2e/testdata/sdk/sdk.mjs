// sdk.mjs drives the LLM gateway with the official openai SDK for
// internal/e2e/sdk_test.go, which checks what it prints (one JSON object a
// line) against the stand-in LLM and the ledger.
//
//   node sdk.mjs chat KEY STREAM        one call (STREAM 0 or 1)
//   node sdk.mjs parallel KEY N         N calls at once; "denied" as each 429 arrives
//
// Environment: QF_GATEWAY_URL, the gateway's base URL. Calls never retry
// (maxRetries 0), so the test counts every one.
import OpenAI from 'openai';

const [mode, key, arg] = process.argv.slice(2);
const client = new OpenAI({ baseURL: process.env.QF_GATEWAY_URL + '/v1', apiKey: key, maxRetries: 0 });
const request = { model: 'gpt-4o', max_tokens: 50, messages: [{ role: 'user', content: 'Say hello five times.' }] };
const print = (o) => console.log(JSON.stringify(o));

// failure describes an error as the SDK surfaced it.
function failure(err) {
  return {
    error: err.constructor.name,
    rateLimit: err instanceof OpenAI.RateLimitError,
    status: err.status ?? 0,
    code: err.code ?? '',
    retryAfter: err.headers?.get('retry-after') ?? '',
    shouldRetry: err.headers?.get('x-should-retry') ?? '',
    message: err.message,
  };
}

// chat makes one call and returns its text, usage and remaining quota; a
// stream broken midway keeps the text received and its error.
async function chat(stream) {
  const out = { text: '', usage: null, remaining: '' };
  try {
    const { data, response } = await client.chat.completions.create({ ...request, stream }).withResponse();
    out.remaining = response.headers.get('x-ratelimit-remaining') ?? '';
    if (!stream) {
      out.text = data.choices[0].message.content;
      out.usage = data.usage;
      return out;
    }
    for await (const chunk of data) {
      out.text += chunk.choices[0]?.delta?.content ?? '';
      if (chunk.usage) out.usage = chunk.usage;
    }
  } catch (err) {
    Object.assign(out, failure(err));
  }
  return out;
}

switch (mode) {
  case 'chat':
    print(await chat(arg === '1'));
    break;
  case 'parallel': {
    const results = await Promise.all(
      Array.from({ length: Number(arg) }, async () => {
        const r = await chat(false);
        if (r.rateLimit) print({ denied: true }); // the test releases the held answers once all are decided
        return r;
      }),
    );
    print({
      ok: results.filter((r) => !r.error).length,
      denied: results.filter((r) => r.rateLimit).length,
      other: results.filter((r) => r.error && !r.rateLimit).map((r) => r.message),
    });
    break;
  }
  default:
    console.error(`sdk.mjs: unknown mode ${mode}`);
    process.exit(2);
}
