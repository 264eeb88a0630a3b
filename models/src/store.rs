//! Named parameters and buffers in registration order, with PyTorch's initializers and
//! safetensors import/export.

use crate::error::Misshaped;
use crate::tags::{ExpertParam, ParamTags, SharedGroup};
use crate::ModelError;
use std::collections::HashMap;
use std::path::Path;
use tch::{Device, Kind, TchError, Tensor};

/// Options every zoo tensor is created with (CPU, fp32: what references train in).
pub(crate) const F32: (Kind, Device) = (Kind::Float, Device::Cpu);

/// A model's parameters and buffers, by PyTorch module path, in registration order.
///
/// Tensors are created once and only ever updated in place, so every handle (a layer's,
/// an optimizer's, a tied alias) keeps seeing the same tensor.
#[derive(Debug, Default)]
pub struct ParamStore {
    params: Vec<(String, Tensor)>,
    buffers: Vec<(String, Tensor)>,
    tags: ParamTags,
    /// While set, new parameters under `.1` copy the registered ones under `.0` instead of
    /// drawing: how `nn.TransformerEncoder` deep-copies its first layer.
    copy_from: Option<(String, String)>,
}

impl ParamStore {
    /// Registers a trainable parameter. `init` runs only when the value is not copied from a
    /// template (see [`ParamStore::copying`]), so random draws follow PyTorch's order.
    pub(crate) fn param(
        &mut self,
        name: &str,
        init: impl FnOnce() -> Result<Tensor, TchError>,
    ) -> Result<Tensor, TchError> {
        let value = match self.template_of(name) {
            Some(src) => tch::no_grad(|| src.f_detach_copy())?,
            None => tch::no_grad(init)?,
        };
        let t = value.set_requires_grad(true);
        self.params.push((name.to_owned(), t.shallow_clone()));
        Ok(t)
    }

    /// Registers a buffer (no gradient).
    pub(crate) fn buffer(&mut self, name: &str, value: Tensor) -> Tensor {
        self.buffers.push((name.to_owned(), value.shallow_clone()));
        value
    }

    /// Registers `value` as a trainable parameter under `name` (PyTorch's
    /// `register_parameter`): how a model outside the zoo exposes its weights to Lockstep's
    /// wrappers, records and checkpoints. Returns the handle the model computes with; the
    /// store and the model then share one tensor, updated in place by every optimizer.
    pub fn register_parameter(&mut self, name: &str, value: Tensor) -> Tensor {
        let t = value.detach().set_requires_grad(true);
        self.params.push((name.to_owned(), t.shallow_clone()));
        t
    }

    /// Registers a buffer (running statistics, constants) under `name` (PyTorch's
    /// `register_buffer`): ranks must agree on buffers too, and records compare them.
    pub fn register_buffer(&mut self, name: &str, value: Tensor) -> Tensor {
        self.buffer(name, value)
    }

    fn template_of(&self, name: &str) -> Option<Tensor> {
        let (from, to) = self.copy_from.as_ref()?;
        let rest = name.strip_prefix(to.as_str())?;
        let src = format!("{from}{rest}");
        self.params
            .iter()
            .find(|(n, _)| *n == src)
            .map(|(_, t)| t.shallow_clone())
    }

    /// Whether `name` gets drawn (not copied from a template) when registered.
    pub(crate) fn is_fresh(&self, name: &str) -> bool {
        self.template_of(name).is_none()
    }

    /// Makes parameters registered under `to` copies of those under `from` until
    /// [`ParamStore::stop_copying`] (PyTorch's `copy.deepcopy` of a template layer).
    pub(crate) fn copying(&mut self, from: &str, to: &str) {
        self.copy_from = Some((from.to_owned(), to.to_owned()));
    }

    pub(crate) fn stop_copying(&mut self) {
        self.copy_from = None;
    }

    /// Re-draws every parameter under `prefix` with more than one dimension from
    /// Xavier-uniform, in registration order (`nn.Transformer._reset_parameters`).
    pub(crate) fn xavier_reinit(&self, prefix: &str) -> Result<(), TchError> {
        for (name, t) in &self.params {
            if name.starts_with(prefix) && t.dim() > 1 {
                xavier_uniform_(t)?;
            }
        }
        Ok(())
    }

    /// Declares `alias` a second name of the registered parameter `canonical`.
    pub(crate) fn alias(&mut self, canonical: &str, alias: &str) {
        match self
            .tags
            .shared
            .iter_mut()
            .find(|g| g.canonical == canonical)
        {
            Some(g) => g.aliases.push(alias.to_owned()),
            None => self.tags.shared.push(SharedGroup {
                canonical: canonical.to_owned(),
                aliases: vec![alias.to_owned()],
            }),
        }
    }

    /// Marks parameter `name` as belonging to expert `expert` of its mixture: expert
    /// parallelism places it on the rank holding that expert.
    pub fn tag_expert(&mut self, name: &str, expert: usize) {
        self.tags.experts.push(ExpertParam {
            name: name.to_owned(),
            expert,
        });
    }

    pub(crate) fn tag_rank_local(&mut self, name: &str) {
        self.tags.rank_local.push(name.to_owned());
    }

    /// Trainable parameters (tied ones once, under the canonical name), as shallow handles.
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.params
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
    }

    /// Buffers, as shallow handles.
    pub fn named_buffers(&self) -> Vec<(String, Tensor)> {
        self.buffers
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
    }

    /// The parameter called `name` (canonical or alias).
    pub fn get(&self, name: &str) -> Option<Tensor> {
        let name = self.tags.canonical(name);
        self.params
            .iter()
            .chain(&self.buffers)
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.shallow_clone())
    }

    /// Shared, expert and rank-local groups, as registered by the model.
    pub fn tags(&self) -> &ParamTags {
        &self.tags
    }

    /// Trainable scalars, tied parameters counted once.
    pub fn num_parameters(&self) -> i64 {
        self.params.iter().map(|(_, t)| t.numel() as i64).sum()
    }

    /// Writes parameters then buffers to `path` (safetensors). Tied parameters are written
    /// once, under their canonical name, as safetensors refuses aliased storage.
    pub fn save(&self, path: &Path) -> Result<(), ModelError> {
        let mut out = Vec::with_capacity(self.params.len() + self.buffers.len());
        for (name, t) in self.params.iter().chain(&self.buffers) {
            out.push((
                name.as_str(),
                t.f_detach()?.f_to_device(Device::Cpu)?.f_contiguous()?,
            ));
        }
        Tensor::write_safetensors(&out, path)?;
        Ok(())
    }

    /// Loads `path` into the registered tensors in place, all or nothing.
    pub fn load(&self, path: &Path, model: &str) -> Result<(), ModelError> {
        let shown = path.display().to_string();
        let file: HashMap<String, Tensor> = Tensor::read_safetensors(path)
            .map_err(|e| ModelError::UnreadableState {
                path: shown.clone(),
                reason: e.to_string(),
            })?
            .into_iter()
            .collect();
        let mut missing = Vec::new();
        let mut misshaped = Vec::new();
        for (name, t) in self.params.iter().chain(&self.buffers) {
            match file.get(name) {
                None => missing.push(name.clone()),
                Some(v) if v.size() != t.size() || v.kind() != t.kind() => {
                    misshaped.push(Misshaped {
                        name: name.clone(),
                        expected: describe(t),
                        found: describe(v),
                    })
                }
                Some(_) => {}
            }
        }
        let mut unexpected = Vec::new();
        let mut aliases = Vec::new();
        for key in file.keys() {
            let known = self
                .params
                .iter()
                .chain(&self.buffers)
                .any(|(n, _)| n == key);
            if known {
                continue;
            }
            let canonical = self.tags.canonical(key);
            if canonical != key.as_str() {
                aliases.push((canonical.to_owned(), key.clone()));
            } else {
                unexpected.push(key.clone());
            }
        }
        if !missing.is_empty() || !misshaped.is_empty() || !unexpected.is_empty() {
            unexpected.sort();
            return Err(ModelError::StateMismatch {
                path: shown,
                model: model.to_owned(),
                missing,
                misshaped,
                unexpected,
            });
        }
        // PyTorch state dicts repeat a tied weight under every name: accept that, but only
        // when the copies agree, since loading one would silently drop the other.
        for (canonical, alias) in aliases {
            let same = match (file.get(&canonical), file.get(&alias)) {
                (Some(a), Some(b)) => a.size() == b.size() && a.kind() == b.kind() && a.equal(b),
                _ => false,
            };
            if !same {
                return Err(ModelError::TiedMismatch {
                    path: shown,
                    canonical,
                    alias,
                });
            }
        }
        tch::no_grad(|| -> Result<(), ModelError> {
            for (name, t) in self.params.iter().chain(&self.buffers) {
                if let Some(v) = file.get(name) {
                    let mut dst = t.shallow_clone();
                    dst.f_copy_(v)?;
                }
            }
            Ok(())
        })
    }
}

fn describe(t: &Tensor) -> String {
    format!("{:?} {:?}", t.kind(), t.size())
}

/// `nn.Linear`'s weight: Kaiming-uniform with `a = sqrt(5)`, i.e. U(-1/sqrt(fan_in), ..),
/// computed as PyTorch computes the bound so the draws match its values.
pub(crate) fn linear_weight(out_features: i64, in_features: i64) -> Result<Tensor, TchError> {
    let a = 5f64.sqrt();
    let gain = (2.0 / (1.0 + a.powi(2))).sqrt();
    let std = gain / (in_features as f64).sqrt();
    let bound = 3f64.sqrt() * std;
    Tensor::f_empty([out_features, in_features], F32)?.f_uniform_(-bound, bound)
}

/// `nn.Linear`'s bias: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
pub(crate) fn linear_bias(out_features: i64, in_features: i64) -> Result<Tensor, TchError> {
    let bound = 1.0 / (in_features as f64).sqrt();
    Tensor::f_empty([out_features], F32)?.f_uniform_(-bound, bound)
}

/// Xavier-uniform in place (gain 1), as `nn.init.xavier_uniform_`.
pub(crate) fn xavier_uniform_(t: &Tensor) -> Result<(), TchError> {
    let size = t.size();
    let receptive: i64 = size.iter().skip(2).product();
    let fan_in = size.get(1).copied().unwrap_or(1) * receptive;
    let fan_out = size.first().copied().unwrap_or(1) * receptive;
    let std = (2.0 / (fan_in + fan_out) as f64).sqrt();
    let a = 3f64.sqrt() * std;
    tch::no_grad(|| t.shallow_clone().f_uniform_(-a, a).map(|_| ()))
}

/// N(0, 1), as `nn.Embedding`'s weight.
pub(crate) fn normal(shape: &[i64]) -> Result<Tensor, TchError> {
    Tensor::f_empty(shape, F32)?.f_normal_(0.0, 1.0)
}

pub(crate) fn ones(shape: &[i64]) -> Result<Tensor, TchError> {
    Tensor::f_ones(shape, F32)
}

pub(crate) fn zeros(shape: &[i64]) -> Result<Tensor, TchError> {
    Tensor::f_zeros(shape, F32)
}
