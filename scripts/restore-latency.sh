#!/bin/bash
# Daemon-side template restore latency of a bash session, from the daemon's
# debug log ("cr restore" phases summed: the time Engine.Restore took).
# Usage: scripts/restore-latency.sh [BIN [N]]   (root; BIN defaults to bin/rewind)
set -e

BIN=${1:-bin/rewind}; N=${2:-30}; D=$(mktemp -d)
$BIN daemon --state $D/state --socket $D/s.sock --log-level debug > $D/log 2>&1 &
DP=$!
sleep 1.5
export REWIND_NO_AUTOSTART=1
$BIN create sb1 --socket $D/s.sock > /dev/null
$BIN session start sb1 --id sh --socket $D/s.sock -- bash > /dev/null
$BIN session send sb1 sh 'cd /tmp; export V=1; echo hi > /tmp/f' --socket $D/s.sock > /dev/null
CK=$($BIN checkpoint sb1 --socket $D/s.sock | grep -o 'ck-[0-9a-f]*' | head -1)
sleep 0.5
for i in $(seq $N); do
  $BIN restore sb1 $CK --socket $D/s.sock > /dev/null || echo restore failed
  $BIN session send sb1 sh 'echo x > /tmp/g' --socket $D/s.sock > /dev/null
  sleep 0.05
done
kill $DP; wait $DP 2>/dev/null || true
python3 - $D/log <<'PY'
import sys,re,statistics
tot=[];sw=[]
for l in open(sys.argv[1]):
    if 'cr restore' not in l: continue
    us=[int(x) for k,x in re.findall(r'(\S+)_us=(\d+)',l) if not k.startswith('copies.')]
    tot.append(sum(us)/1000)
    m=re.search(r'switch_fs_us=(\d+)',l)
    if m: sw.append(int(m.group(1))/1000)
print("n",len(tot),"cr restore p50 %.3f ms"%statistics.median(tot), "switch_fs p50 %.3f"%(statistics.median(sw) if sw else -1))
PY
rm -rf $D
