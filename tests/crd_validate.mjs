// Validates prometheus-operator objects (JSON array in the file named by argv[2]) against the CRDs' OpenAPI schemas,
// as packaged by @kubernetes-models/prometheus-operator (npm). Run from the folder where that package is installed
// (.npm-crds, made by the README's test command). Prints "ok KIND" or "invalid KIND <path> <message>" per object.
import fs from "node:fs";
import { PodMonitor, PrometheusRule, ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1";

const kinds = { PodMonitor, PrometheusRule, ServiceMonitor };
const docs = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
let invalid = 0;
for (const doc of docs) {
  const Kind = kinds[doc.kind];
  try {
    if (!Kind) throw new Error(`no schema for kind ${doc.kind}`);
    new Kind(doc).validate();
    console.log("ok", doc.kind);
  } catch (error) {
    invalid++;
    console.log("invalid", doc.kind, error.message.replace(/\s+/g, " ").slice(0, 400));
  }
}
// exitCode, not process.exit(): exit() may end the process before stdout (a pipe) is flushed
process.exitCode = invalid ? 1 : 0;
