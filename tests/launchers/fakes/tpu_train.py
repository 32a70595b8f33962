"""A training script for TPU launch tests: records what it saw, then sleeps or fails when asked."""

import json
import os
import sys
import time


def main():
    out = os.environ.get("TPU_TRAIN_OUT")
    record = {"pid": os.getpid(), "argv": sys.argv, "cwd": os.getcwd(), "worker": os.environ.get("TPU_WORKER_ID"),
              "env": {k: os.environ.get(k) for k in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16", "ACCELERATE_DEBUG_MODE",
                                                      "FORK_LAUNCHED", "ACCELERATE_IN_TPU_POD", "HF_TOKEN", "MY_FLAG",
                                                      "FROM_CONFIG", "FORWARDED")}}
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{os.getpid()}.json"), "w") as handle:
            json.dump(record, handle)
    print(f"training on worker {record['worker']} pid {os.getpid()} args {sys.argv[1:]}", flush=True)
    mode = os.environ.get("TPU_TRAIN_MODE", "")
    if mode == "sleep":
        time.sleep(300)
    if mode == "fail":
        sys.exit(7)


def other_entry():
    main()


if __name__ == "__main__":
    main()
