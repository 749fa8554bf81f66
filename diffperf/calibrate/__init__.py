"""Fitting the efficiency factors: parameterisation, dataset and loss, the fit, cross-validation,
the Laplace uncertainty, prediction intervals and batch prediction of a CSV."""

from ._batch_predict import predict_csv as predict_csv
from ._cv import cross_validate as cross_validate
from ._fit import Fit as Fit, Parameterisation as Parameterisation, calibrate as calibrate
from ._uncertainty import (
    FitUncertainty as FitUncertainty,
    PredictionInterval as PredictionInterval,
    load_uncertainty as load_uncertainty,
    prediction_interval as prediction_interval,
)
