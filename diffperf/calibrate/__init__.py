"""Fitting the efficiency factors: parameterisation, dataset and loss, the fit, cross-validation,
the Laplace uncertainty, model errors measured on held-out rows, prediction intervals and batch
prediction of a CSV."""

from ._batch_predict import predict_csv as predict_csv
from ._cv import cross_validate as cross_validate
from ._fit import calibrate as calibrate
from ._held_out import measure_inference_errors as measure_inference_errors
from ._parameterisation import Parameterisation as Parameterisation
from ._results import Fit as Fit
from ._uncertainty import (
    FitUncertainty as FitUncertainty,
    PredictionInterval as PredictionInterval,
    load_uncertainty as load_uncertainty,
    prediction_interval as prediction_interval,
)
