import os


def device_type():
    return os.environ.get("FAKE_XLA_DEVICE_TYPE", "CPU")
