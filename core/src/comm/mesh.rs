//! `DeviceMesh`: ranks laid out on named dimensions (`pp`, `dp`, `fsdp`, `tp`, `ep`, …),
//! handing out one process group per dimension, as torch's DeviceMesh does.

use crate::comm::{CommError, ProcessGroup, World};
use std::sync::Arc;

/// A row-major grid of the world's ranks with one group per named dimension.
///
/// Rank `r` sits at coordinates given by row-major order over the dimensions as listed, so
/// with `[("dp", 2), ("tp", 2)]` ranks 0 and 1 share a `tp` group and ranks 0 and 2 a `dp`
/// group.
pub struct DeviceMesh {
    names: Vec<String>,
    sizes: Vec<usize>,
    coords: Vec<usize>,
    groups: Vec<Arc<dyn ProcessGroup>>,
}

impl DeviceMesh {
    /// Lays the world out on `dims` (name, size) and creates every dimension's groups. Every
    /// rank must call it with the same dimensions.
    pub fn new(world: &World, dims: &[(&str, usize)]) -> Result<DeviceMesh, CommError> {
        let sizes: Vec<usize> = dims.iter().map(|d| d.1).collect();
        let names: Vec<String> = dims.iter().map(|d| d.0.to_owned()).collect();
        let product: usize = sizes.iter().product();
        let shape = dims
            .iter()
            .map(|(n, s)| format!("{n}={s}"))
            .collect::<Vec<_>>()
            .join(", ");
        if dims.is_empty() || sizes.contains(&0) || product != world.size() {
            return Err(CommError::InvalidArgument(format!(
                "world size {} does not fit the mesh [{shape}] (its dimensions multiply to {product})",
                world.size()
            )));
        }
        for (i, n) in names.iter().enumerate() {
            if names[..i].contains(n) {
                return Err(CommError::InvalidArgument(format!(
                    "mesh dimension {n:?} appears twice in [{shape}]"
                )));
            }
        }
        let coords = coords_of(world.rank(), &sizes);
        let mut groups = Vec::with_capacity(dims.len());
        for (d, name) in names.iter().enumerate() {
            let partition = partition_along(&sizes, d);
            let group = world.new_groups(&partition, name)?.ok_or_else(|| {
                CommError::InvalidArgument(format!("rank {} is in no {name} group", world.rank()))
            })?;
            groups.push(group);
        }
        Ok(DeviceMesh {
            names,
            sizes,
            coords,
            groups,
        })
    }

    /// The group along dimension `name`.
    pub fn group(&self, name: &str) -> Result<Arc<dyn ProcessGroup>, CommError> {
        let d = self.dim(name)?;
        Ok(self.groups[d].clone())
    }

    /// This rank's coordinate along `name`.
    pub fn coordinate(&self, name: &str) -> Result<usize, CommError> {
        Ok(self.coords[self.dim(name)?])
    }

    /// The size of dimension `name`.
    pub fn size(&self, name: &str) -> Result<usize, CommError> {
        Ok(self.sizes[self.dim(name)?])
    }

    /// Dimension names in layout order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    fn dim(&self, name: &str) -> Result<usize, CommError> {
        self.names.iter().position(|n| n == name).ok_or_else(|| {
            CommError::InvalidArgument(format!(
                "mesh has no dimension {name:?} (it has {:?})",
                self.names
            ))
        })
    }
}

fn coords_of(rank: usize, sizes: &[usize]) -> Vec<usize> {
    let mut coords = vec![0; sizes.len()];
    let mut rest = rank;
    for d in (0..sizes.len()).rev() {
        coords[d] = rest % sizes[d];
        rest /= sizes[d];
    }
    coords
}

/// The groups along dimension `d`: ranks that agree on every other coordinate.
pub(crate) fn partition_along(sizes: &[usize], d: usize) -> Vec<Vec<usize>> {
    let total: usize = sizes.iter().product();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut keys: Vec<Vec<usize>> = Vec::new();
    for r in 0..total {
        let mut key = coords_of(r, sizes);
        key[d] = 0;
        match keys.iter().position(|k| *k == key) {
            Some(i) => groups[i].push(r),
            None => {
                keys.push(key);
                groups.push(vec![r]);
            }
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_by_two_partitions() {
        assert_eq!(partition_along(&[2, 2], 0), vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(partition_along(&[2, 2], 1), vec![vec![0, 1], vec![2, 3]]);
        assert_eq!(
            partition_along(&[2, 3], 0),
            vec![vec![0, 3], vec![1, 4], vec![2, 5]]
        );
    }
}
