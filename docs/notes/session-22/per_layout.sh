#!/bin/bash
# replay all 28 saved tune sets with checkout $1, keep each replay's JSON (first line) in /tmp/pl_$2/, then
# aggregate the held-out signed errors by layout (python per_layout.py /tmp/pl_$2)
NOTES=/work/main/docs/notes
OUT=/tmp/pl_${2:-out}; mkdir -p $OUT
cd "${1:-/work/main}"
# the 28 saved sets of sessions 9-20 (session 21's replay_all.sh replays the same ones)
for n in K L M N P Q R S T U V W X Y Z S16b S16 S18 S18b S18c S19 S19b S19c S19d S20 S20b S20c S20d; do
  f=$(ls $NOTES/session-*/tune-set-$n.json.gz)
  OMP_NUM_THREADS=1 PYTHONPATH=$PWD /work/main/.venv/bin/python benchmarks/tune_local.py --replay $f --json 2>/dev/null | head -1 > $OUT/$n.json
done
/work/main/.venv/bin/python /work/main/docs/notes/session-22/per_layout.py $OUT
