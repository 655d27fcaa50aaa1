// The by-hand image recipes (```sh blocks of the files given) must give a digest Istio
// accepts: istio-agent pulls the WasmPlugin's image and compares the digest of the image
// manifest it gets with the url's (istio/istio pkg/wasm/imagefetcher.go). BuildKit's
// attestations (provenance, SBOM; on by default with Docker's containerd image store) turn
// the tag into an image index, and `docker push` then prints the index's digest. So: every
// `docker build` / `docker buildx build` passes --provenance=false and --sbom=false, the
// digest comes from the registry (`docker buildx imagetools inspect`), never from a
// `docker push` line.
//
// Usage: node image-recipe.mjs MARKDOWN...
import { readFileSync } from "node:fs";

const errors = [];
for (const f of process.argv.slice(2)) {
  let sh = false;
  const lines = [];
  readFileSync(f, "utf8").split("\n").forEach((l, i) => {
    if (/^\s*```sh\s*$/.test(l)) sh = true;
    else if (/^\s*```\s*$/.test(l)) sh = false;
    else if (sh) {
      if (lines.length && lines.at(-1).text.endsWith("\\")) lines.at(-1).text = lines.at(-1).text.slice(0, -1) + " " + l.trim();
      else lines.push({ text: l.trim(), n: `${f}:${i + 1}` });
    }
  });
  const builds = lines.filter((l) => /\bdocker (buildx )?build\b/.test(l.text));
  for (const b of builds) {
    for (const flag of ["--provenance=false", "--sbom=false"]) {
      if (!b.text.includes(flag)) errors.push(`${b.n}: docker build without ${flag}: the attestations make the tag an image index, whose digest istio-agent refuses (it compares the image manifest's): add ${flag}`);
    }
  }
  for (const p of lines.filter((l) => /\bdocker push\b/.test(l.text) && /digest/i.test(l.text))) {
    errors.push(`${p.n}: the digest \`docker push\` prints can be an image index's (attestations, containerd store): pin the image manifest's digest the registry reports (\`docker buildx imagetools inspect\`)`);
  }
  if (builds.length && !lines.some((l) => /imagetools inspect/.test(l.text))) errors.push(`${f}: a docker build recipe that does not read the digest back from the registry (docker buildx imagetools inspect)`);
}
for (const e of errors) console.error(`FAIL ${e}`);
if (errors.length) process.exit(1);
console.log(`ok: ${process.argv.length - 2} recipe file(s): docker builds without attestations, digests read from the registry`);
