#!/usr/bin/env python3
"""Checkpoint backup to S3 ([backup], core/io/checkpoint_backup.h) against a real S3-protocol server.

Each scenario starts moto's standalone server (PyPI moto[server]) as its own process on a free
port, runs the trainer on the bundled corpus, and checks what arrived with boto3, an independent
client:
  signed        moto checking every request's SigV4 signature against an IAM user's keys: the
                checkpoints arrive at their keys, each with a manifest (uploaded last) whose sizes
                and SHA-256 match the local files; backup.keep_last = 2 leaves exactly the newest
                two in the bucket (checkpoint.keep_last = 1 locally); the keys appear nowhere in
                the run directory or the output
  resume        a fresh out_dir (keys in a shared credentials file's profile this time) with
                checkpoint.resume = auto takes the newest *complete*
                checkpoint from the bucket (the newest one's manifest is deleted first, as if its
                upload had not finished) and continues bit for bit: the same losses at every later
                step and the same final model and optimizer bytes as the uninterrupted run
  sharded       the same under tensor_parallel with 2 ranks (every rank's pieces in shards/; rank 0
                downloads on the new machine while rank 1 waits)
  killed        the server killed (SIGKILL) in the middle of a multipart upload (small preset,
                5 MiB parts, the upload rate capped so the kill lands mid-file) and started again
                empty: the uploader retries, starts the forgotten upload again, sends the files the
                server lost, then the manifest; everything matches the local checkpoint
  no-bucket     the bucket missing: one warning naming it, training finishes, checkpoints intact;
                a server that cannot be reached on a resume=auto with no local checkpoint: one
                error (never a silent fresh start)
  no-keys       no credentials: one error naming the problem before compute, exit non-zero

  tools/s3_backup_test.py build/trainer [--only signed,resume]
Exits non-zero when a check fails. Needs tools/requirements.txt's moto[server] and boto3.
"""
import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import boto3

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAILURES = []


def check(condition, message):
    print(("  ok   " if condition else "  FAIL ") + message, flush=True)
    if not condition:
        FAILURES.append(message)
    return condition


class Moto:
    """moto's server on a free port; `auth` makes it check signatures against an IAM user."""

    def __init__(self, workdir, auth=False, port=None):
        self.workdir, self.auth = workdir, auth
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port, self.endpoint = port, f"http://127.0.0.1:{port}"
        self.start()

    def start(self):
        env = dict(os.environ)
        if self.auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "4"  # the set-up below; every later request is checked
        self.log = open(os.path.join(self.workdir, f"moto-{self.port}.log"), "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError("moto's server did not start")
        self.keys = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing-secret"}
        if self.auth:
            iam = boto3.client("iam", endpoint_url=self.endpoint, region_name="us-east-1", **self.keys)
            iam.create_user(UserName="weft")
            iam.put_user_policy(UserName="weft", PolicyName="s3", PolicyDocument=json.dumps(
                {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
            key = iam.create_access_key(UserName="weft")["AccessKey"]
            self.keys = {"aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]}

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.log.close()

    def s3(self):
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", **self.keys)

    def env(self):
        return {"AWS_ACCESS_KEY_ID": self.keys["aws_access_key_id"],
                "AWS_SECRET_ACCESS_KEY": self.keys["aws_secret_access_key"]}


def trainer_args(trainer, out, *sets):
    args = [trainer, "--config", f"{ROOT}/configs/tiny.toml", "--set", f"data.path={ROOT}/data/austen/austen.jsonl",
            "--set", f"data.cache_dir={out}/../cache", "--set", f"train.out_dir={out}", "--set", "log.progress=off",
            "--set", "eval.every_steps=0"]
    for s in sets:
        args += ["--set", s]
    return args


def run(args, env_extra=None, wait=True):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["OMP_NUM_THREADS"] = "1"
    env.update(env_extra or {})
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                            errors="replace")
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=600)
    return proc.returncode, out


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def bucket_checkpoints(s3, bucket, prefix):
    """{checkpoint: {relative path: size}} of every key under prefix."""
    found = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            name, _, rel = obj["Key"][len(prefix):].partition("/")
            if name.startswith("step-"):
                found.setdefault(name, {})[rel] = obj["Size"]
    return found


def check_against(s3, bucket, prefix, name, local_dir):
    """The checkpoint `name` in the bucket: a manifest listing exactly local_dir's files, whose
    objects have the manifest's sizes and SHA-256 and the local files' bytes."""
    manifest = json.loads(s3.get_object(Bucket=bucket, Key=f"{prefix}{name}/manifest.json")["Body"].read())
    local = sorted(os.path.relpath(os.path.join(d, f), local_dir) for d, _, fs in os.walk(local_dir) for f in fs)
    ok = check(sorted(f["path"] for f in manifest["files"]) == local,
               f"{name}: the manifest lists the local checkpoint's {len(local)} files")
    for f in manifest["files"]:
        body = s3.get_object(Bucket=bucket, Key=f"{prefix}{name}/{f['path']}")["Body"].read()
        local_sha = sha256(os.path.join(local_dir, f["path"])) if os.path.exists(os.path.join(local_dir, f["path"])) else None
        ok = ok and len(body) == f["size"] and hashlib.sha256(body).hexdigest() == f["sha256"] == local_sha
    return check(ok, f"{name}: every object has its manifest's size and SHA-256, and the local file's bytes")


def losses(out):
    found = {}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if record.get("type") == "step":
                found[record["step"]] = record["loss"]
    return found


def scenario_signed(trainer, work):
    moto = Moto(work, auth=True)
    try:
        s3 = moto.s3()
        s3.create_bucket(Bucket="ckpt")
        out = os.path.join(work, "signed")
        code, text = run(trainer_args(trainer, out, "train.max_steps=6", "checkpoint.every_steps=2",
                                      "checkpoint.keep_last=1", "backup.url=s3://ckpt/runs/signed",
                                      f"backup.endpoint={moto.endpoint}", "backup.keep_last=2"), moto.env())
        check(code == 0, f"the run with backup finished (exit {code})")
        # weft logs a refused request as "HTTP 403 <S3 code>"; a bare "403" may be in the endpoint's
        # random port, a size or a rate.
        check("HTTP 403" not in text and "SignatureDoesNotMatch" not in text,
              "moto accepted every signed request (no HTTP 403 in the output)")
        found = bucket_checkpoints(s3, "ckpt", "runs/signed/")
        # A checkpoint still queued when the next comes is superseded, so which ones were sent varies.
        sent = [line.split("backup: ")[1].split()[0] for line in text.splitlines() if " uploaded to s3://" in line]
        check(len(sent) >= 2 and sent[-1] == "step-00000006" and sorted(found) == sent[-2:],
              f"backup.keep_last = 2: the bucket holds the newest two of those sent {sent} (found {sorted(found)})")
        check(found and all("manifest.json" in files for files in found.values()), "each has its manifest")
        latest = s3.get_object(Bucket="ckpt", Key="runs/signed/latest")["Body"].read().decode().strip()
        check(latest == "step-00000006", f"the bucket's latest names the last one uploaded ({latest})")
        if "step-00000006" in found:
            check_against(s3, "ckpt", "runs/signed/", "step-00000006", os.path.join(out, "checkpoints", "step-00000006"))
        secret = moto.keys["aws_secret_access_key"]
        leaked = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs
                  if secret.encode() in open(os.path.join(d, f), "rb").read()]
        check(not leaked and secret not in text, f"the secret key is in no file of the run directory nor the output {leaked}")
        check(not any(n.startswith(".tmp") for n in os.listdir(os.path.join(out, "checkpoints"))),
              "no backup snapshot left in checkpoints/")
    finally:
        moto.kill()


def scenario_resume(trainer, work, plugin=(), tag="resume"):
    moto = Moto(work)
    try:
        s3 = moto.s3()
        s3.create_bucket(Bucket="ckpt")
        sets = ["train.max_steps=8", "checkpoint.every_steps=2", "checkpoint.keep_last=8",
                f"backup.url=s3://ckpt/{tag}", f"backup.endpoint={moto.endpoint}", "backup.keep_last=8"]
        first = os.path.join(work, f"{tag}-first")
        code, text = run(trainer_args(trainer, first, *sets) + list(plugin), moto.env())
        check(code == 0, f"the uninterrupted run finished (exit {code})")
        # The newest checkpoint's upload "did not finish": its manifest is gone, its files are there.
        s3.delete_object(Bucket="ckpt", Key=f"{tag}/step-00000008/manifest.json")
        # The newest complete one left (a checkpoint queued when the next came was superseded, so
        # which ones were sent varies).
        complete = sorted(n for n, files in bucket_checkpoints(s3, "ckpt", f"{tag}/").items() if "manifest.json" in files)
        check(bool(complete), f"the bucket holds complete checkpoints before step 8: {complete}")
        newest = complete[-1] if complete else "step-00000000"
        at = int(newest.split("-")[1])
        second = os.path.join(work, f"{tag}-second")
        # The new machine has its keys in a shared credentials file, under a named profile.
        credentials = os.path.join(work, "credentials")
        with open(credentials, "w") as f:
            f.write("[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong\n\n[weft]\n"
                    f"aws_access_key_id = {moto.keys['aws_access_key_id']}\n"
                    f"aws_secret_access_key = {moto.keys['aws_secret_access_key']}\n")
        code, text = run(trainer_args(trainer, second, *sets, "checkpoint.resume=auto") + list(plugin),
                         {"AWS_SHARED_CREDENTIALS_FILE": credentials, "AWS_PROFILE": "weft"})
        check(code == 0, f"the run on a fresh out_dir finished (exit {code})")
        check(f"credentials from {credentials} [weft]" in text, "it took the keys from the credentials file's profile")
        check(f"downloading {newest}" in text and "resumed from" in text and f"at step {at} " in text,
              f"it took {newest} from the bucket (step 8 has no manifest) and resumed there")
        a, b = losses(first), losses(second)
        later = [s for s in a if s > at]
        check(later and all(a[s] == b.get(s) for s in later) and min(b) == at + 1,
              f"steps {later} have the uninterrupted run's losses, bit for bit")
        step8 = "checkpoints/step-00000008"
        files = sorted(os.path.relpath(os.path.join(d, f), f"{first}/{step8}") for d, _, fs in os.walk(f"{first}/{step8}")
                       for f in fs if f.endswith(".safetensors"))
        check(files and all(sha256(f"{first}/{step8}/{f}") == sha256(f"{second}/{step8}/{f}") for f in files),
              f"step 8's {files} equal the uninterrupted run's, byte for byte")
        check_against(s3, "ckpt", f"{tag}/", "step-00000008", f"{second}/{step8}")
    finally:
        moto.kill()


def scenario_sharded(trainer, work):
    """The same with tensor_parallel's 2 ranks: each rank's pieces (shards/) go up, and on the new
    machine rank 0 downloads while rank 1 waits, then both resume."""
    scenario_resume(trainer, work, ("--plugin", "tensor_parallel", "--nproc", "2"), "sharded")


def scenario_killed(trainer, work):
    moto = Moto(work)
    try:
        moto.s3().create_bucket(Bucket="ckpt")
        out = os.path.join(work, "killed")
        # small preset, full fine-tuning: model 24 MB, optimizer 49 MB, sent as 5 MiB parts at 8 MB/s.
        proc = run(trainer_args(trainer, out, "model.preset=small", "train.max_steps=2", "checkpoint.every_steps=2",
                                "backup.url=s3://ckpt/killed", f"backup.endpoint={moto.endpoint}",
                                "backup.part_size_mb=5", "backup.max_mb_per_s=8", "backup.retries=6"),
                   moto.env(), wait=False)
        s3, killed, deadline = moto.s3(), False, time.monotonic() + 300
        while not killed and proc.poll() is None and time.monotonic() < deadline:
            try:
                for upload in s3.list_multipart_uploads(Bucket="ckpt").get("Uploads", []):
                    parts = s3.list_parts(Bucket="ckpt", Key=upload["Key"], UploadId=upload["UploadId"]).get("Parts", [])
                    if parts:
                        print(f"  killing the server: {upload['Key']} has {len(parts)} part(s)", flush=True)
                        moto.kill()
                        killed = True
                        break
            except Exception:
                pass
            time.sleep(0.05)
        check(killed, "the server was killed in the middle of a multipart upload")
        if killed:
            time.sleep(1.0)
            moto.start()  # empty: the bucket, the upload and the files sent so far are gone
            moto.s3().create_bucket(Bucket="ckpt")
        text, _ = proc.communicate(timeout=600)
        check(proc.returncode == 0, f"training finished (exit {proc.returncode})")
        print("\n".join("    " + l for l in text.splitlines() if "backup" in l), flush=True)
        check("attempt 1 of" in text, "the failed requests were retried")
        check("sending the file again" in text, "the upload the server forgot was started again")
        check("uploaded to" in text and "0 failed" in text, "the backup completed")
        check_against(moto.s3(), "ckpt", "killed/", "step-00000002", os.path.join(out, "checkpoints", "step-00000002"))
    finally:
        moto.kill()


def scenario_no_bucket(trainer, work):
    moto = Moto(work)
    try:
        out = os.path.join(work, "no-bucket")
        code, text = run(trainer_args(trainer, out, "train.max_steps=4", "checkpoint.every_steps=2",
                                      "backup.url=s3://missing-bucket/x", f"backup.endpoint={moto.endpoint}"), moto.env())
        warnings = [line for line in text.splitlines() if "warning" in line and "backup" in line]
        check(code == 0, f"training finished (exit {code})")
        check(len(warnings) == 1 and "missing-bucket" in warnings[0] and "does not exist" in warnings[0],
              f"one warning names the missing bucket: {warnings}")
        latest = open(os.path.join(out, "checkpoints", "latest")).read().strip()
        check(latest == "step-00000004" and os.path.exists(os.path.join(out, "checkpoints", latest, "trainer_state.json")),
              "the local checkpoints are intact")
        # A server that cannot be reached must not pass for an empty bucket when a new machine resumes.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        fresh = os.path.join(work, "unreachable")
        code, text = run(trainer_args(trainer, fresh, "train.max_steps=4", "checkpoint.resume=auto",
                                      "backup.url=s3://ckpt/x", f"backup.endpoint=http://127.0.0.1:{closed}",
                                      "backup.retries=1"), moto.env())
        errors = [line for line in text.splitlines() if " error " in line]
        check(code != 0 and len(errors) == 1 and "cannot be reached" in errors[0] and "not starting from scratch" in errors[0]
              and not os.path.exists(os.path.join(fresh, "metrics.jsonl")),
              f"resume=auto with the server unreachable: one error, no fresh start: {errors}")
    finally:
        moto.kill()


def scenario_no_keys(trainer, work):
    out = os.path.join(work, "no-keys")
    empty_home = os.path.join(work, "home")
    os.makedirs(empty_home, exist_ok=True)
    code, text = run(trainer_args(trainer, out, "train.max_steps=2", "backup.url=s3://ckpt/x"), {"HOME": empty_home})
    errors = [line for line in text.splitlines() if " error " in line]
    check(code != 0 and len(errors) == 1 and "no AWS credentials" in errors[0], f"one error names the problem: {errors}")
    check(not os.path.exists(os.path.join(out, "metrics.jsonl")), "before any step ran")


SCENARIOS = {"signed": scenario_signed, "resume": scenario_resume, "sharded": scenario_sharded, "killed": scenario_killed,
             "no-bucket": scenario_no_bucket, "no-keys": scenario_no_keys}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trainer")
    parser.add_argument("--only", default=",".join(SCENARIOS))
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="weft-s3-")
    try:
        for name in args.only.split(","):
            print(f"{name}:", flush=True)
            start = time.monotonic()
            SCENARIOS[name](os.path.abspath(args.trainer), work)
            print(f"  ({time.monotonic() - start:.1f} s)", flush=True)
    finally:
        if args.keep:
            print(f"work directory: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
