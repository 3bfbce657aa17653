// Greedy ids and top-2 log-probability gaps from llama.cpp (the CPU build inside the npm package
// node-llama-cpp 3.21.1, installed outside the project: llama.cpp is never a dependency), for
// tests/data/llamacpp_greedy.json and by-hand cross-checks.
// Usage: NODE_PATH=/path/to/node_modules node scripts/llamacpp-greedy.mjs MODEL.gguf N_GEN
//          [PROMPT_IDS=1,17,99,42,300,7,256,500] [CONTEXT=512] [THREADS=2]
// Prints one JSON object: {"ids": [...], "top2_logit_gap": [...]}. The KV cache is f32 (its f16
// cache rounds queries and attention weights to f16), the prompt is evaluated as raw ids.
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const { getLlama } = await import(require.resolve("node-llama-cpp", { paths: (process.env.NODE_PATH || "").split(":") }));

const [modelPath, nGenArg, promptArg = "1,17,99,42,300,7,256,500", contextArg = "512", threadsArg = "2"] =
  process.argv.slice(2);
if (!modelPath || !nGenArg) {
  console.error("usage: node scripts/llamacpp-greedy.mjs MODEL.gguf N_GEN [PROMPT_IDS] [CONTEXT] [THREADS]");
  process.exit(2);
}
const llama = await getLlama({ gpu: false, logLevel: "error" });
const model = await llama.loadModel({ modelPath, gpuLayers: 0 });
const context = await model.createContext({
  contextSize: Number(contextArg), threads: Number(threadsArg), batchSize: 512,
  experimentalKvCacheKeyType: "F32", experimentalKvCacheValueType: "F32",
});
const sequence = context.getSequence();
let input = promptArg.split(",").map(Number);
const ids = [], gaps = [];
for (let step = 0; step < Number(nGenArg); ++step) {
  const items = input.map((t, i) => (i === input.length - 1 ? [t, { generateNext: { probabilities: true } }] : t));
  const out = await sequence.controlledEvaluate(items);
  const probs = [...out[out.length - 1].next.probabilities.entries()].sort((a, b) => b[1] - a[1]);
  ids.push(probs[0][0]);
  gaps.push(probs.length > 1 ? Math.log(probs[0][1]) - Math.log(probs[1][1]) : Infinity);
  input = [probs[0][0]];
}
console.log(JSON.stringify({ ids, top2_logit_gap: gaps.map((g) => Number(g.toFixed(4))) }));
await context.dispose();
await model.dispose();
