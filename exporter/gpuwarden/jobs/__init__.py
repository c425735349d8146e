"""The job view: which GPUs of this node run one job, what their processes do, and the job judged as one.

The job view: which GPUs of this node run one job (grouping, launchers), what their processes do on the host
(activity, evidence), and the job judged as one (the collective rules, the findings). Below runtime/, above the
stages it reads (attribution/, health/), which never import it."""
