"""TPU: the plan (one host or a pod), the runner a single-host plan starts, the pod driver, gcloud commands."""
