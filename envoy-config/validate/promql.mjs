// PromQL helpers shared by metric-names.mjs and alert-series.mjs.

const PROMQL_WORDS = new Set([
  "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
  "unless", "atan2", "inf", "nan", "Inf", "NaN", "start", "end",
]);

// Metric and recording-rule names referenced by one PromQL expression.
export function promqlNames(expr) {
  let s = expr
    .replace(/"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`/g, '""') // strings
    .replace(/\{[^}]*\}/g, " ") // label matchers
    .replace(/\[[^\]]*\]/g, " ") // ranges and subqueries
    .replace(/\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)/g, " ") // label lists
    .replace(/\$\{?\w+\}?/g, " "); // dashboard variables
  const names = [];
  for (const m of s.matchAll(/(?<![A-Za-z0-9_.:])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?/g)) {
    const [, word, call] = m;
    if (call) continue; // function or aggregation
    if (PROMQL_WORDS.has(word)) continue;
    if (/^\d/.test(word)) continue;
    // durations / numbers like 6h, 1e6 are not matched (they start with a digit)
    names.push(word);
  }
  return names;
}
