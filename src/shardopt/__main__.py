"""``python -m shardopt`` runs the demo (same flags as ``python -m shardopt.demo``)."""

from shardopt.demo import main

if __name__ == "__main__":
  main()
