"""target=tpu through the gcloud CLI: the target (`target`: create, ship, run, follow, delete), the
gcloud command lines (`commands`), slice shapes, runtimes and zones (`shapes`), and the follower that
runs on worker 0 of a detached job (`follow`)."""
