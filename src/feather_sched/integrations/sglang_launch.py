"""``python -m feather_sched.integrations.sglang_launch``: the SGLang launcher's public
path, kept; the launcher is ``integrations.sglang.launch``."""

from feather_sched.integrations.sglang.launch import main

if __name__ == "__main__":
    main()
