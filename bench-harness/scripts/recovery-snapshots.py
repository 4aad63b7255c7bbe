# Recovery time of N durable counters with snapshots: add to every
# counter twice (snapshot_every = 1 -> each has a snapshot), kill -9, restart,
# time to ready, then read every counter back over HTTP (pipelined).
# Usage: python3 bench-harness/scripts/recovery-snapshots.py \
#          target/release/shardline 100000 [DIR]
# DIR (default /tmp/shardline-recovery) is deleted and recreated. Ports
# 127.0.0.1:27500/27550/27600. The node is stopped at the end.
import os, socket, subprocess, sys, time, signal
BIN = sys.argv[1]; N = int(sys.argv[2]); D = sys.argv[3] if len(sys.argv) > 3 else "/tmp/shardline-recovery"
os.system(f"rm -rf {D}; mkdir -p {D}")
cfg = f"""cluster_address = "127.0.0.1:27500"
client_address = "127.0.0.1:27550"
http_address = "127.0.0.1:27600"
seed_nodes = ["127.0.0.1:27500"]
data_cores = 1
pin_cores = false
data_dir = "{D}/node"
number_of_shards = 100
durability = {{ interval_ms = 1 }}
[[entity_types]]
name = "counter"
kind = "counter"
idle_timeout_ms = 0
active_entity_limit = 0
snapshot_every = 1
"""
open(f"{D}/n.toml","w").write(cfg)
def start():
    t=time.time()
    p=subprocess.Popen([BIN,"node","--config",f"{D}/n.toml"],stdout=subprocess.PIPE,stderr=open(f"{D}/log","a"),text=True)
    for line in p.stdout:
        if line.startswith("shardline: ready"): break
    return p, time.time()-t
def run(op, expect=None):
    s=socket.create_connection(("127.0.0.1",27600)); s.settimeout(60)
    buf=b""; bad=0; B=200
    for base in range(0,N,B):
        req=b"".join(f"POST /v1/entities/counter/c-{i} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(op)}\r\n\r\n{op}".encode() for i in range(base,min(N,base+B)))
        s.sendall(req)
        got=0
        while got < min(N,base+B)-base:
            while b"\r\n\r\n" not in buf: buf+=s.recv(65536)
            h,rest=buf.split(b"\r\n\r\n",1)
            cl=int([l.split(b":")[1] for l in h.split(b"\r\n") if l.lower().startswith(b"content-length")][0])
            while len(rest)<cl: rest+=s.recv(65536)
            body=rest[:cl]; buf=rest[cl:]
            if not h.startswith(b"HTTP/1.1 200") or (expect is not None and body!=expect): bad+=1
            got+=1
    s.close(); return bad
p,_=start()
t=time.time(); b1=run("add 1"); b2=run("add 1"); print(f"wrote 2 adds x {N} in {time.time()-t:.1f}s, bad {b1+b2}")
time.sleep(0.5)
p.send_signal(signal.SIGKILL); p.wait()
os.system(f"du -sh {D}/node")
p,ready=start()
t=time.time(); bad=run("get", b"2"); read=time.time()-t
print(f"restart: ready in {ready:.2f}s; all {N} counters recovered and read in {read:.2f}s; wrong {bad}")
p.send_signal(signal.SIGTERM); p.wait()
