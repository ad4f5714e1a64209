"""Burn's "Distributed Data Parallel Training" example: ExecutionStrategy.ddp + Learner.

    python examples/burn/ddp_training.py                 # DDP over 2 logical CPU devices
    python examples/burn/ddp_training.py --devices 4 --epochs 3
    python examples/burn/ddp_training.py --cuda          # every GPU (untested without one)

The page's Rust::

    let devices = Device::enumerate(DeviceType::Cuda).into_vec();
    let strategy = ExecutionStrategy::ddp(devices, DistributedConfig { all_reduce_op: Mean });
    let model = ModelConfig::new().init(&strategy.main_device().clone().autodiff());
    let training = SupervisedTraining::new(artifact_dir, dataloader_train, dataloader_valid)
        .with_training_strategy(strategy.into())
        .num_epochs(config.num_epochs);
    let result = training.launch(Learner::new(model, optimizer, lr_scheduler));

One model replica and one worker thread per device; each global batch of 64 is split across
the devices, every replica runs forward and backward on its shard, and the gradients are
averaged (ReduceOperation.Mean) during backward, so every replica makes the same update. The
data are scikit-learn's 8x8 digits (bundled with it: nothing is downloaded); expect about 95%
validation accuracy after 2 epochs. The checkpoint goes to --artifact-dir (default: a fresh
temporary directory); launching again with the same directory resumes after its last epoch.
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np

import tensorlib as tl
import tensorlib.functional as F
from collectives.distributed import DistributedConfig, ReduceOperation
from ddp import DataLoader
from ddp.learner import ExecutionStrategy, Learner, SupervisedTraining
from tensorlib import Device, DeviceType, nn, optim

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--devices", type=int, default=2, help="logical CPU devices (default 2)")
parser.add_argument("--cuda", action="store_true", help="every visible GPU instead (untested)")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--artifact-dir", default=None, help="checkpoint directory (default: temp)")
args = parser.parse_args()
if args.devices < 1 or args.epochs < 1:
    parser.error("--devices and --epochs must be at least 1")

# The digits (1,797 8x8 images, 10 classes), standardized; a fixed 80/20 split.
try:
    from sklearn.datasets import load_digits
except ImportError:
    raise SystemExit("this example needs scikit-learn: pip install -e '.[examples]'") from None
x, y = load_digits(return_X_y=True)
order = np.random.default_rng(0).permutation(len(x))
x, y = x[order].astype(np.float32), y[order].astype(np.int64)
x = (x - x.mean(axis=0)) / (x.std(axis=0) + 1.0)
n_valid = len(x) // 5
dataloader_train = DataLoader((x[n_valid:], y[n_valid:]), batch_size=64, shuffle=True, seed=0)
dataloader_valid = DataLoader((x[:n_valid], y[:n_valid]), batch_size=256)

# List all available devices: logical CPU devices stand in for GPUs here.
tl.set_cpu_device_count(args.devices)
devices = Device.enumerate(DeviceType.Cuda if args.cuda else DeviceType.Cpu).into_vec()
if not devices:
    raise SystemExit("no GPU here (--cuda needs one, and CuPy: pip install .[cuda12])")
strategy = ExecutionStrategy.ddp(devices, DistributedConfig(all_reduce_op=ReduceOperation.Mean))
print(f"strategy: {strategy!r}")

# Init the model on the main device (tensorlib tensors always record autodiff: no
# `.autodiff()` backend to wrap).
tl.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(strategy.main_device())
optimizer = optim.AdamW(model.parameters(), lr=1e-2)
lr_scheduler = optim.lr_scheduler.CosineAnnealingLR(
    optimizer, T_max=args.epochs * len(dataloader_train)
)  # stepped once per optimizer step, as Burn's learner does

# Launch DDP training. A (x, y) batch becomes a loss through loss_fn(model(x), y); a model
# with train_step(batch)/valid_step(batch) needs no loss_fn (Burn's TrainStep/ValidStep).
artifact_dir = args.artifact_dir or tempfile.mkdtemp(prefix="burn-ddp-")
training = (
    SupervisedTraining(artifact_dir, dataloader_train, dataloader_valid, loss_fn=F.cross_entropy)
    .with_training_strategy(strategy)
    .num_epochs(args.epochs)
)
result = training.launch(Learner(model, optimizer, lr_scheduler))

# The learner printed a line per epoch; the result holds the trained model (back on the main
# device) and the same figures.
last = result.history[-1]
print(
    f"trained {len(result.history)} epoch(s) with DDP over {len(devices)} device(s): final "
    f"valid loss {last.valid_loss:.4f}, valid accuracy {last.valid_accuracy:.2%}"
)
print(f"model on {next(iter(result.model.parameters())).device}, checkpoint {result.checkpoint}")
