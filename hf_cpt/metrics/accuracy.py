"""Accuracy: the fraction of predictions equal to the references.

A local copy of the `evaluate` "accuracy" metric (same inputs and output), shipped with hf_cpt so that
``evaluate.load`` works offline and gives the same result online. Load it with
``hf_cpt.metrics.load_metric("accuracy")``.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """
Accuracy is the proportion of correct predictions among the total number of cases processed:
Accuracy = (TP + TN) / (TP + TN + FP + FN).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): Predicted labels.
    references (`list` of `int`): Ground truth labels.
    normalize (`boolean`): If False, return the number of correctly classified samples. Defaults to True.
    sample_weight (`list` of `float`): Sample weights. Defaults to None.

Returns:
    accuracy (`float` or `int`): Accuracy score, in [0, 1] (or a count if normalize is False).

Examples:
    >>> accuracy_metric = hf_cpt.metrics.load_metric("accuracy")
    >>> accuracy_metric.compute(references=[0, 1, 2, 0, 1, 2], predictions=[0, 1, 1, 2, 1, 0])
    {'accuracy': 0.5}
"""

_CITATION = """
@article{scikit-learn,
  title={Scikit-learn: Machine Learning in {P}ython},
  author={Pedregosa, F. and others},
  journal={Journal of Machine Learning Research},
  volume={12},
  pages={2825--2830},
  year={2011}
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("int32")),
                    "references": datasets.Sequence(datasets.Value("int32")),
                }
                if self.config_name == "multilabel"
                else {
                    "predictions": datasets.Value("int32"),
                    "references": datasets.Value("int32"),
                }
            ),
            reference_urls=["https://huggingface.co/spaces/evaluate-metric/accuracy"],
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        predictions = np.asarray(predictions)
        references = np.asarray(references)
        if predictions.shape != references.shape:
            raise ValueError(f"predictions {predictions.shape} and references {references.shape} differ in shape.")
        correct = predictions == references
        if correct.ndim > 1:  # multilabel: a sample is correct when all its labels are
            correct = correct.all(axis=tuple(range(1, correct.ndim)))
        correct = correct.astype(np.float64)
        if sample_weight is not None:
            weights = np.asarray(sample_weight, dtype=np.float64)
            score = float((correct * weights).sum())
            return {"accuracy": score / float(weights.sum()) if normalize else score}
        if normalize:
            return {"accuracy": float(correct.mean()) if correct.size else 0.0}
        return {"accuracy": int(correct.sum())}
