// Keeps the deployment docs short where they are read in a hurry: in each YAML document
// (between `---`), comment lines may not outnumber the YAML lines they explain (rationale
// goes to docs/DESIGN.md); in the Markdown tables, a cell may hold a few lines (350
// characters) at most.
//
// Usage: node docs-shape.mjs --yaml FILE... --md FILE...
import { readFileSync } from "node:fs";

const lists = { yaml: [], md: [] };
let cur = null;
for (const a of process.argv.slice(2)) {
  if (a.startsWith("--")) cur = a.slice(2);
  else lists[cur].push(a);
}
const MAX_CELL = 350;
const errors = [];
for (const f of lists.yaml) {
  readFileSync(f, "utf8").split(/^---\s*$/m).forEach((doc, i) => {
    const lines = doc.split("\n").filter((l) => l.trim());
    const comments = lines.filter((l) => /^\s*#/.test(l)).length;
    if (comments > lines.length - comments) errors.push(`${f} document ${i + 1}: ${comments} comment lines for ${lines.length - comments} YAML lines (move the rationale to docs/DESIGN.md)`);
  });
}
for (const f of lists.md) {
  readFileSync(f, "utf8").split("\n").forEach((l, i) => {
    if (!l.startsWith("|")) return;
    for (const c of l.trim().replace(/^\||\|$/g, "").split(/(?<!\\)\|/)) {
      if (c.trim().length > MAX_CELL) errors.push(`${f}:${i + 1}: a table cell of ${c.trim().length} characters (> ${MAX_CELL}): "${c.trim().slice(0, 60)}…"`);
    }
  });
}
for (const e of errors) console.error(`FAIL ${e}`);
if (!errors.length) console.log(`ok: ${lists.yaml.length} YAML files, ${lists.md.length} Markdown files`);
process.exit(errors.length ? 1 : 0);
